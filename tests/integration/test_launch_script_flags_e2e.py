"""The run flags of miles' launch scripts through the whole loop (local Ray, the embedded engine, the torch
trainer, a tiny model): --dump-details writes each rollout's samples and train batch where miles does and
--load-debug-rollout-data replays them; --wandb-key is written nowhere; --eval-top-p and --eval-top-k reach
the engine's eval sampling, a dataset's own value winning."""

from __future__ import annotations

import pytest
import torch
import yaml

from miles.cli.train import main as train_main
from miles.runtime import read_trace
from miles.rollout.debug_data import load_rollout_data
from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

KEY = "0123456789abcdef0123456789abcdef01234567"


def test_dump_details_writes_both_dumps_and_its_rollouts_replay(ray_cluster, tiny_task, tmp_path):
    dump = tmp_path / "dump"
    assert train_main(base_flags(tiny_task, tmp_path / "run", num_rollout=2, dump_details=dump, wandb_key=KEY,
                                 use_fault_tolerance=True, progress="off")) == 0
    assert sorted(p.name for p in (dump / "rollout_data").iterdir()) == ["0.pt", "1.pt"]
    assert sorted(p.name for p in (dump / "train_data").iterdir()) == ["0_0.pt", "1_0.pt"]
    assert (dump / "tokenizer" / "tokenizer_config.json").is_file()
    assert len(load_rollout_data(dump / "rollout_data" / "1.pt", expect_rollout_id=1).samples) == 16
    # --wandb-key: in no file the run wrote (config.yaml, the trace, the actors' logs), redacted in config.yaml
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert written and [p for p in written if KEY.encode() in p.read_bytes()] == []
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["tracking"]["wandb_key"] == "<redacted>" and config["rollout"]["use_fault_tolerance"] is True

    # miles' replay of a --dump-details run: the trainer alone, the same batches
    replay = tmp_path / "dump2"
    assert train_main(base_flags(tiny_task, tmp_path / "replay", num_rollout=2, dump_details=replay,
                                 load_debug_rollout_data=f"{dump}/rollout_data/{{rollout_id}}.pt", progress="off")) == 0
    trace = read_trace(tmp_path / "replay")
    assert trace.events[0].machine == "train_only"
    assert [e.get("loaded_from") for e in trace.of("rollout_done")] == [str(dump / "rollout_data" / f"{r}.pt")
                                                                      for r in (0, 1)]
    assert not (replay / "rollout_data").exists()              # nothing was generated to dump
    for name in ("0_0.pt", "1_0.pt"):
        first, again = (torch.load(d / "train_data" / name, weights_only=True) for d in (dump, replay))
        for key in ("tokens", "loss_mask", "advantages", "rollout_logprobs"):
            assert torch.equal(first[key], again[key]), (name, key)
    assert miles_actors() == []


SIGNATURES = '''
import zlib

def eval_log(ctx, data, metrics):
    for name, samples in data.items():
        metrics[f"sig/{name}"] = float(zlib.crc32(repr([list(s.response_ids) for s in samples]).encode()))
'''


def test_eval_top_p_and_top_k_reach_the_engines_eval_sampling(ray_cluster, tiny_task, tmp_path):
    # at temperature 1, top-p 1e-6 or top-k 1 leave only the likeliest token: the responses are the greedy
    # ones. A dataset that turns both off samples (from a random tiny model: other responses).
    (tmp_path / "sig.py").write_text(SIGNATURES)
    (tmp_path / "evals.yaml").write_text(yaml.safe_dump({"eval": {
        "defaults": {"path": tiny_task["eval"], "n_samples_per_eval_prompt": 2},
        "datasets": [{"name": "flags"}, {"name": "top_k_only", "top_p": 1.0}, {"name": "top_p_only", "top_k": -1},
                     {"name": "own", "top_p": 1.0, "top_k": -1}, {"name": "greedy", "temperature": 0}]}}))
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=1, eval_config=tmp_path / "evals.yaml",
                            eval_interval=1, eval_temperature=1.0, eval_top_p=1e-6, eval_top_k=1,
                            custom_eval_rollout_log_function_path=f"{tmp_path / 'sig.py'}:eval_log"))
    assert result.final_state == "shutdown"
    first = next(r for r in result.metrics if r.get("kind") == "eval")
    greedy = first["sig/greedy"]
    assert (first["sig/flags"], first["sig/top_k_only"], first["sig/top_p_only"]) == (greedy, greedy, greedy)
    assert first["sig/own"] != greedy
