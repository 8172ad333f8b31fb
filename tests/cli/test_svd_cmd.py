"""``detjac svd``: top singular triplets from products, through click's CliRunner."""

from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine import InMemoryEngine, jacobian, load_model

PROMPT = "The fog rolls over the bay in the morning"
ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(.*) \| \[(\d+) (.*), (\d+)%\] (.*)$", flags=re.M)


pytestmark = pytest.mark.usefixtures("one_thread")


def _sigmas(output: str) -> list[float]:
    return [float(r[1]) for r in ROW.findall(output)]


def test_svd_command_prints_triplets_that_match_the_formed_jacobian(llama_checkpoint, tmp_path):
    out = tmp_path / "triplets.npz"
    result = CliRunner().invoke(main, ["svd", str(llama_checkpoint), "-p", PROMPT, "--k", "4", "--top", "3",
                                       "--compare", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "never formed" in text and "converged, max residual" in text
    assert float(re.search(r"reconstruction error of J x \(one product\)\s+(\S+)", text).group(1)) < 1e-12
    rows = ROW.findall(text)
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert all(float(r[2]) <= 1e-8 and len(re.findall(r"'[^']*'", r[3])) == 3 for r in rows)
    assert float(re.search(r"top 4 singular values (\S+)", text).group(1)) <= 1e-8
    again = CliRunner().invoke(main, ["svd", str(llama_checkpoint), "-p", PROMPT, "--out", str(out)])
    assert again.exit_code == 1 and "exists (--force replaces it)" in again.output  # refused before any work
    saved = np.load(out)
    n = int(saved["token_ids"].shape[0])
    assert saved["U"].shape == (32, 4) and saved["V"].shape == (n, 32, 4) and saved["S"].shape == (4,)
    J = jacobian(InMemoryEngine(load_model(llama_checkpoint)), saved["token_ids"].tolist()).combined().numpy()
    V = saved["V"].reshape(n * 32, 4)
    np.testing.assert_allclose(J @ V, saved["U"] * saved["S"], rtol=0, atol=1e-8 * saved["S"][0])
    np.testing.assert_allclose(_sigmas(text), saved["S"], rtol=1e-4)


def test_streamed_svd_command_from_a_prompt_file(llama_checkpoint, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n", encoding="utf-8")
    args = ["svd", str(llama_checkpoint), "--prompt-file", str(prompt_file), "--k", "3"]
    streamed = CliRunner().invoke(main, [*args, "--streamed", "--product-block", "5"])
    in_memory = CliRunner().invoke(main, args)
    assert streamed.exit_code == 0 and in_memory.exit_code == 0, streamed.output + in_memory.output
    assert "layers streamed one at a time" in streamed.output
    assert _sigmas(streamed.output) == _sigmas(in_memory.output) and len(_sigmas(streamed.output)) == 3


def test_svd_command_errors_are_clean(llama_checkpoint):
    runner = CliRunner()
    too_many = runner.invoke(main, ["svd", str(llama_checkpoint), "-p", PROMPT, "--k", "33"])
    assert too_many.exit_code == 1 and "Traceback" not in too_many.output
    assert "Error: Expected k between 1 and the rank bound min(d_model, n_tokens * d_model) = 32" in too_many.output
    neither = runner.invoke(main, ["svd", str(llama_checkpoint)])
    assert neither.exit_code == 2 and "Expected exactly one of --prompt and --prompt-file." in neither.output
    empty = runner.invoke(main, ["svd", str(llama_checkpoint), "-p", ""])
    assert empty.exit_code == 1 and "Error: Expected a prompt" in empty.output
