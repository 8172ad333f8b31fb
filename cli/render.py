"""Text rendering of Jacobian results for the terminal (no heavy imports at module level)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import click

from detjac.sinks import sink_note
from detjac.tokens import piece, pieces


def echo_prediction(result: Any, tokenizer: Any, stock_logit_diff: float | None = None) -> None:
    """Tokens, next token with its probability, and the reconstruction error."""
    click.echo(f"  tokens ({len(result.token_ids)}): {pieces(tokenizer, result.token_ids)}")
    probs = result.logits.softmax(-1)
    agree = "same" if result.reconstructed_next_token_id == result.next_token_id else "DIFFERENT"
    click.echo(f"  next token {piece(tokenizer, result.next_token_id)} (p={float(probs[result.next_token_id]):.3f}); "
               f"from the reconstruction sum_k J_k x_k: {agree}")
    line = f"  {str(result.dtype).removeprefix('torch.')} reconstruction error {result.reconstruction_error:.2e}"
    if stock_logit_diff is not None:
        line += f"; max |logit - stock logit| {stock_logit_diff:.2e}"
    click.echo(line)


def echo_explanation(expl: Any, tokenizer: Any, per_token_k: int = 1) -> None:
    """Combined operator's triplets in full, then the leading ``per_token_k`` of every token
    (:meth:`detjac.engine.tools.triplets.Explanation.lines`)."""
    for line in replace(expl, tokenizer=tokenizer).lines(per_token_k):
        click.echo(line)


SHOWN_FAILURES = 20  # failed prompts listed at the end of a run (all are in the store)


def echo_run_outcome(outcome: Any) -> None:
    """The counts of a ``detjac run``, its model loads per worker, its failed prompts, and an interruption."""
    summary, out = outcome.summary, outcome.out
    failed = f"{len(summary.failed)} failed, " if outcome.distributed else ""
    if summary.worst_error is not None:
        errors = (f"worst reconstruction error this run {summary.worst_error:.2e} (|sum_k J_k x_k - y| / |y| as the "
                  "engine computed it, before storing)")
    else:
        stored = outcome.stored_worst_error
        errors = "no prompt computed this run" + (
            f" (worst reconstruction error recorded in the store {stored:.2e}; `detjac store verify` recomputes)"
            if stored is not None else "")
    click.echo(f"done: {summary.written} written, {summary.skipped_complete} already complete, {failed}"
               f"{summary.duplicates} duplicates, {summary.blank_lines} blank lines; {outcome.total} prompts in {out}; "
               + errors)
    if summary.loads:
        counts = sorted({n for n, _ in summary.loads.values()})
        seconds = sum(s for _, s in summary.loads.values()) / len(summary.loads)
        each = f"{counts[0]} each" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} per worker"
        click.echo(f"model loads: {len(summary.loads)} workers, {each}, {seconds:.2f} s per worker on average")
    if summary.failed:
        click.echo(f"failed ({len(summary.failed)}; recorded in {out} under failed/, retried by the next run):")
        for pid, failure in list(summary.failed.items())[:SHOWN_FAILURES]:
            click.echo(f"  line {failure.line} ({pid}, {failure.stage}): {failure.reason}")
        if len(summary.failed) > SHOWN_FAILURES:
            click.echo(f"  ... and {len(summary.failed) - SHOWN_FAILURES} more: detjac store info {out}")
    if outcome.interrupted:
        kept = f"{outcome.total} prompt{'' if outcome.total == 1 else 's'}"
        click.echo(f"interrupted: {kept} kept in {out}; run the same command again to resume.")
    lens = outcome.lens
    if lens is not None and lens.get("uncounted"):
        click.echo(f"lens: {lens['uncounted']} committed prompts are not counted in the lens's sums (a worker died "
                   "before it wrote them); run the same command again: it recomputes them, then writes lens/fitted.")
    elif lens is not None:
        click.echo(f"lens: layers {', '.join(map(str, lens['layers']))}, {lens['count'][0]} prompts each; written to "
                   f"{out}/lens/fitted (detjac lens save / apply / evaluate read it)")


def echo_decoded(spectra: list[Any]) -> None:
    """Each decoded spectrum (:class:`detjac.analysis.decoded.DecodedSpectrum`): sigma, left and right tokens."""
    for spec in spectra:
        click.echo(f"\n{spec.title}\n  {spec.target}, {spec.operator}")
        for t in spec.triplets:
            click.echo(f"  #{t.index} sigma {t.sigma:<9.4g} left -> {t.left}")
            flag = sink_note(t.right_token, t.right_share, combined=spec.token is None)
            where = f"token {t.right_token}, {t.right_share:.0%}{'; ' + flag if flag else ''}"
            click.echo(f"     right [{where}] -> {t.right}")


def echo_dims(rows: list[dict[str, Any]]) -> None:
    """The dimensionality table of ``detjac analyze dims``."""
    click.echo(f"{'prompt':<17} {'token':>8} {'stable rank':>11} {'part. ratio':>11} {'n90':>4} {'n99':>4}")
    for r in rows:
        click.echo(f"{r['prompt_id']:<17} {r['token']!s:>8} {r['stable_rank']:>11.2f} "
                   f"{r['participation_ratio']:>11.2f} {r['n90']:>4} {r['n99']:>4}")


def echo_graph_neurons(result: Any, top: int) -> None:
    """The recurring neurons of ``detjac analyze graphs`` (a ``GraphNeurons``): the first ``top`` rows."""
    skipped = f"; {len(result.without_graph)} prompts without a graph skipped" if result.without_graph else ""
    positions = (f"; neurons at position{'s' * (len(result.skipped_positions) > 1)} "
                 f"{', '.join(map(str, result.skipped_positions))} left out" if result.skipped_positions else "")
    click.echo(f"{len(result.rows)} neurons in {result.n_graphs} graphs{skipped}{positions}")
    click.echo(f"{'layer':>5} {'index':>6} {'graphs':>6} {'share':>6} {'nodes':>5} {'mean attr.':>10} "
               f"{'mean act.':>10}  label")
    for r in result.rows[:top]:
        click.echo(f"{r['layer']:>5} {r['index']:>6} {r['graphs']:>6} {r['share']:>6.0%} {r['nodes']:>5} "
                   f"{r['mean_attribution']:>10.3g} {r['mean_activation']:>10.3g}  {r['label']}")
    if len(result.rows) > top:
        click.echo(f"... {len(result.rows) - top} more (--top, --table)")


def echo_layer_report(report: Any) -> None:
    """The layer table, where the tracked token emerges, and the files written (a ``LayerReport``)."""
    text = report.token_text
    click.echo(f"{'prompt':<17} {'target':<14} {'sigma_1':>9} {'srank':>7} {'n90':>4} {'u1 rank':>7} "
               f"{'lens rank':>9}  u_1 decoded")
    for r in report.rows:
        click.echo(f"{r['prompt_id']:<17} {r['target']:<14} {r['sigma_1']:>9.4g} {r['stable_rank']:>7.2f} "
                   f"{r['n90']:>4} {r['u1_rank']:>7} {r['lens_rank']:>9}  "
                   f"{' '.join(text(t) for t in r['u1_tokens'][:6])}")
    for e in report.emerged:
        click.echo(f"{e['prompt_id']} {e['component']:<5} tracking {text(e['token'])}: in the top {report.top} of u_1 "
                   f"from layer {e['first_layer_u1'] if e['first_layer_u1'] >= 0 else 'never'}, of the logit lens "
                   f"from layer {e['first_layer_lens'] if e['first_layer_lens'] >= 0 else 'never'}")
    click.echo(report.targets)
    click.echo(f"wrote {', '.join(p.name for p in report.written)} to {report.out}")


def echo_compare(report: Any) -> None:
    """Detached against ordinary, per prompt, the prediction's hits in u_1, and the files written."""
    rows = report.rows
    click.echo(f"{'prompt':<17} {'error det':>9} {'error ord':>9} {'sigma1 det':>10} {'sigma1 ord':>10} "
               f"{'srank det':>9} {'srank ord':>9} {'u1 det':>6} {'u1 ord':>6}")
    for r in rows:
        click.echo(f"{r['prompt_id']:<17} {r['detached_error']:>9.1e} {r['ordinary_error']:>9.1e} "
                   f"{r['detached_sigma_1']:>10.4g} {r['ordinary_sigma_1']:>10.4g} {r['detached_stable_rank']:>9.2f} "
                   f"{r['ordinary_stable_rank']:>9.2f} {'hit' if r['detached_u1_hit'] else '-':>6} "
                   f"{'hit' if r['ordinary_u1_hit'] else '-':>6}")
    click.echo(f"prediction among the top-{report.top} decoded tokens of u_1: detached {report.hits[0]}/{len(rows)}, "
               f"ordinary {report.hits[1]}/{len(rows)}")
    click.echo(f"wrote {report.plot}")
    if report.table is not None:
        click.echo(f"wrote {report.table}")


def echo_steering_table(rows: list[dict[str, Any]]) -> None:
    """One row per strength of a steering evaluation."""
    click.echo(f"{'λ':>6} {'prompts':>7} {'with concept':>12} {'concept/gen':>11} {'distinct':>8}  example")
    for r in rows:
        click.echo(f"{r['strength']:>6g} {r['prompts']:>7} {r['share_with_concept']:>12.0%} "
                   f"{r['concept_per_continuation']:>11.2f} {r['distinct_share']:>8.2f}  {r['example'][:60]!r}")


def listed_prompt(row: Any) -> str:
    """One line of ``store ls`` (a ``Listed``): id, tokens, error, next token, text; or DAMAGED and why."""
    if row.damage is not None:
        return f"{row.id}  DAMAGED: {row.damage}"
    a = row.attrs
    error = a.get("reconstruction_error")
    return (f"{row.id}  {a.get('n_tokens', '?'):>4} tok  err {'-' if error is None else format(error, '.1e')}  "
            f"next {a.get('next_token')!r:<12} {str(a.get('prompt', ''))[:70]!r}")


def echo_verify(result: Any) -> None:
    """What ``store verify`` found (a ``VerifySummary``): each corrupt part, then the counts."""
    for r in result.corrupt:
        where = r.id if r.kind == "prompt" else f"{r.kind} {r.id}"
        click.echo(f"CORRUPT {where}: {r.reason}")
    bad_parts = sum(r.kind != "prompt" for r in result.corrupt)
    worst = ("no Jacobian stored to reconstruct" if result.worst_error is None else
             f"worst reconstruction error {result.worst_error:.2e}, recomputed from the stored J, x and y, so it "
             "may differ from the run's by rounding")
    click.echo(f"{result.ok} of {result.prompts} prompts ok ({worst}); "
               f"{result.prompts - result.ok} corrupt; {result.parts - bad_parts} of {result.parts} other parts ok "
               "(model arrays, analyses, failure records)")
    if result.interrupted:
        shown = ", ".join(result.interrupted[:3]) + (" ..." if len(result.interrupted) > 3 else "")
        click.echo(f"note: {len(result.interrupted)} leftovers of writes killed midway ({shown}): never read as "
                   "results; the next write into the same folder removes them (or delete them).")
    if result.format_version < 2:
        click.echo(f"note: a format-{result.format_version} store has no checksums of its attributes and files: "
                   "verify proved chunk checksums, attribute types, token ids, reconstructions and the model "
                   "arrays; a changed attribute (of a prompt or of the run) or a deleted chunk of a layerwise "
                   "Jacobian or bias (format 1 skipped all-zero chunks there) cannot be detected.")


def echo_store_summary(path: str, summary: Any) -> None:
    """A store's description and counts (a ``StoreSummary``), with its failed prompts."""
    click.echo(f"store {path}: format version {summary.format_version}, created {summary.created}")
    click.echo(json.dumps(summary.run, indent=2, ensure_ascii=False))
    leftovers, failures = summary.staging_leftovers, summary.failures
    damaged = summary.damaged
    click.echo(f"{summary.complete} complete prompts, {summary.disk_bytes / 2**20:.1f} MiB on disk"
               + (f"; {len(damaged)} of them DAMAGED (run `detjac store verify`)" if damaged else "")
               + (f"; {len(leftovers)} partial prompts in staging (redone on the next run)" if leftovers else "")
               + (f"; {len(failures)} failed prompts (retried by the next run):" if failures else ""))
    for pid, record in failures.items():
        click.echo(f"  {pid}  line {record.get('line')} ({record.get('stage')}, {record.get('error')}): "
                   f"{record.get('reason')}")
    for pid, reason in damaged.items():
        click.echo(f"  {pid}  DAMAGED: {reason}")


def echo_prompt_layout(layout: Any) -> None:
    """One prompt's attrs and how its Jacobian is kept (a ``PromptLayout``)."""
    click.echo(json.dumps(layout.attrs, indent=2, ensure_ascii=False))
    if layout.low_rank:
        U, S, V = layout.triplet_shapes
        click.echo(f"low rank: combined U {U}, S {S}, V {V}; per-token triplets of rank "
                   f"{layout.rank} for {layout.n_tokens} tokens")
    elif layout.shape is None:
        click.echo("no Jacobian (--keep none: a `detjac run --lens` prompt; its Jacobians are in the lens sums)")
    else:
        click.echo(f"jacobian {layout.shape} {layout.dtype}, chunks {layout.chunks}")
