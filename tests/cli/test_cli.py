"""The command line, through click's CliRunner."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine.checkpoints.tiny import tiny_model_types


def test_jacobian_command_prints_the_figures(llama_checkpoint):
    result = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "--prompt", "The fog rolls over the",
                                       "--k", "3", "--top", "4", "--row-block", "8"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "tokens      " in out and "'<s>'" in out and "' f' 'og'" in out
    detached, ordinary = map(float, re.search(r"detached (\S+)\s+ordinary (\S+)", out).groups())
    assert detached < 1e-12 and ordinary > 1e-3
    assert "reconstruction argmax agrees" in out
    rows = re.findall(r"^\s+(\d)\s+(\S+)\s+(.*) \| (.*)$", out, flags=re.M)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    sigmas = [float(r[1]) for r in rows]
    assert sigmas == sorted(sigmas, reverse=True) and sigmas[-1] > 0
    assert all(len(re.findall(r"'[^']*'", r[2])) == 4 for r in rows)


def test_jacobian_command_error_is_clean(tmp_path):
    result = CliRunner().invoke(main, ["jacobian", str(tmp_path / "missing"), "--prompt", "x"])
    assert result.exit_code == 1
    assert "Error: Expected a Hugging Face checkpoint directory" in result.output
    assert "Traceback" not in result.output


def test_empty_prompt_error_is_clean(llama_checkpoint):
    result = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "--prompt", ""])
    assert result.exit_code == 1
    assert "Error: Expected a prompt of at least one token. Got an empty string instead." in result.output


def test_help_has_examples():
    runner = CliRunner()
    for args in ([], ["jacobian"], ["families"], ["demo"]):
        out = runner.invoke(main, [*args, "--help"]).output
        assert "Example" in out, args


def test_families_lists_every_family():
    out = CliRunner().invoke(main, ["families"]).output
    for name in ("Llama", "Qwen3", "Gemma3", "Phi3", "Mistral", "OLMo2", "Gemma2", "Qwen2", "GPT-2", "BERT",
                 "Qwen3-MoE", "Mixtral", "OLMoE"):
        assert re.search(rf"^{name} \(model_type: ", out, flags=re.M), name
    assert "Gemma3RMSNorm: variance scale frozen, output norm(x) * (1 + w)" in out
    assert "LayerNorm: mean subtracted (linear), variance scale frozen, output norm(x) * (0 + w) + b" in out
    assert "MixtralSparseMoeBlock: router choice and weights frozen" in out


def test_family_check_reports_exact_reconstruction():
    result = CliRunner().invoke(main, ["families", "--check", "--tokens", "9"])
    assert result.exit_code == 0, result.output
    rows = re.findall(r"^(\w+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(same|DIFF)", result.output, flags=re.M)
    assert len(rows) == len(tiny_model_types())
    for name, det, ordi, stock, agree in rows:
        assert float(det) < 1e-12 and float(ordi) > 1e-3 and float(stock) < 1e-5 and agree == "same", name


def test_help_does_not_import_torch():
    code = "import sys; from detjac.cli.main import main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_store_and_analysis_do_not_import_torch():
    code = "import sys, detjac.store, detjac.analysis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_cli_turns_on_huge_pages_before_torch_unless_told_not_to():
    """PyTorch reads THP_MEM_ALLOC_ENABLE at its first allocation: the CLI sets it before torch is imported and
    keeps a value the user gave."""
    code = ("import os, sys; from detjac.cli.main import main; "
            "print(os.environ['THP_MEM_ALLOC_ENABLE'], 'torch' in sys.modules)")
    for given, expected in ((None, "1 False"), ("0", "0 False")):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if given is not None:
            env["THP_MEM_ALLOC_ENABLE"] = given
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
        assert out.strip() == expected
