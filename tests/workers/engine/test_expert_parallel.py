"""Expert parallelism on the CPU (gloo): a tiny random Mixtral's greedy tokens through the engine with
1, 2 and 4 ranks, against each other and against transformers' MoE implementation."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch

from protocol.models import default_gguf_path
from tests.support.hf_models import hf_greedy
from tests.support.moe_models import NUM_EXPERTS, engine_greedy, mixtral, prompts, save
from tests.support.workers import serve_worker
from workers.bundled_worker import Worker
from workers.engine.batch import ScheduledChunk
from workers.engine.engine_core import EngineConfig
from workers.engine.expert_parallel import ExpertParallelGroup
from workers.engine.loader import convert_gguf
from workers.engine.model import UnsupportedModelError
from workers.engine.sampling_params import SamplingParams
from workers.kv_event_log import KVEventLog

pytestmark = pytest.mark.real

PROMPT_LENS = (1, 6, 13, 22)
MAX_NEW = 8
CONFIG = EngineConfig(block_size=4, num_blocks=64, max_prefill_chunk=9, num_threads=1)


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], Path]:
    """The checkpoint (with SmolLM2's tokenizer files, which the worker's loader wants; the ids compared
    stay below this model's vocabulary) and HF's greedy continuations of the prompts."""
    torch.manual_seed(0)
    hf = mixtral()
    folder = save(hf, tmp_path_factory.mktemp("mixtral-ep"))
    for file in convert_gguf(default_gguf_path()).glob("tokenizer*"):
        shutil.copy(file, folder)
    return hf_greedy(hf, prompts(256, PROMPT_LENS, seed=5), MAX_NEW), folder


def _run(folder: Path, size: int) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    """Greedy tokens, a prompt's last logits, and the rows each MoE call of rank 0 computed."""
    group = ExpertParallelGroup.start(folder, size, CONFIG)
    try:
        tokens = engine_greedy(group.engine, prompts(256, PROMPT_LENS, seed=5), MAX_NEW)
        chunk = ScheduledChunk(99, list(range(3, 40)), 0, list(range(32, 42)), True, SamplingParams())
        logits = group.engine.runner.compute_logits([chunk])  # type: ignore[attr-defined]
    finally:
        group.close()
    exit_codes = [p.exitcode for p in group.processes]
    assert exit_codes == [0] * (size - 1), exit_codes
    return tokens, logits, group.times.rows_computed


def test_greedy_tokens_equal_with_1_2_and_4_ranks_and_hf(
    mixtral_folder: tuple[list[list[int]], Path],
) -> None:
    expected, folder = mixtral_folder
    assert sum(len(e) for e in expected) > 2 * len(expected), "the reference stopped too early to test much"
    runs = {size: _run(folder, size) for size in (1, 2, 4)}
    for size, (tokens, logits, rows) in runs.items():
        assert tokens == expected, size
        torch.testing.assert_close(logits, runs[1][1], atol=1e-5, rtol=0)
        if size > 1:
            # Rank 0 computed only its experts' share of the rows, not every routed row.
            assert 0 < sum(rows) < sum(runs[1][2])


def test_dense_models_and_uneven_splits_are_refused(mixtral_folder: tuple[list[list[int]], Path]) -> None:
    _, folder = mixtral_folder
    with pytest.raises(UnsupportedModelError, match="do not split evenly"):
        ExpertParallelGroup.start(folder, 3, CONFIG)
    assert NUM_EXPERTS % 3
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ExpertParallelGroup.start(convert_gguf(default_gguf_path()), 2, CONFIG)


def test_metrics_show_tokens_per_expert_and_rank(mixtral_folder: tuple[list[list[int]], Path]) -> None:
    _, folder = mixtral_folder
    events = KVEventLog()
    group = ExpertParallelGroup.start(folder, 2, CONFIG, **events.callbacks())
    worker = Worker.around(group.engine, events, worker_id="ep", backend="torch_sdpa")
    running, server = serve_worker(worker, group.engine)
    try:
        reply = running.client().completions.create(
            model=running.model, prompt=list(range(3, 20)), max_tokens=4, temperature=0.0
        )
        text = httpx.get(f"{running.url}/metrics").text
    finally:
        server.stop()
        group.close()
    usage = reply.usage
    # Every token that ran (the prompt, then each generated one but the last) visits 2 experts per layer.
    routed = (usage.prompt_tokens + usage.completion_tokens - 1) * 2 * 2
    assert _sum(text, "prefixgate_worker_moe_expert_tokens_total") == routed
    assert _sum(text, "prefixgate_worker_moe_rank_tokens_total") == routed
    assert 'prefixgate_worker_moe_rank_tokens_total{model_name="' in text and 'rank="1"' in text
    assert _sum(text, "prefixgate_worker_moe_step_rank_imbalance") >= 1.0


def _sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
