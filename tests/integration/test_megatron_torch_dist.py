"""miles' Megatron checkpoints under --train-backend megatron (CPU over gloo; skipped without
megatron-core): a torch_dist checkpoint that megatron-core's dist_checkpointing writes in Megatron-LM's
layout (`iter_0000007/` + `latest_checkpointed_iteration.txt`, the norms under Transformer Engine's
names, as miles' converter writes them) loads as the policy (--load) and as the reference
(--ref-load), and gives the logprobs of the HF weights it was made from, not those of
--hf-checkpoint's weights.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.training.megatron.checks import installed
from tests.integration.test_megatron_cpu import RANK_TIMEOUT_S, configs, free_port, make_model, make_samples

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not installed("megatron.core"), reason="needs megatron-core (pip install miles[megatron])")]

ITERATION = 7


def write_megatron_checkpoint(worker, root: Path) -> None:
    """Megatron-LM's layout, written by megatron-core: the model's sharded state under Transformer Engine's
    layer names, the iteration, and the tracker file."""
    from megatron.core import dist_checkpointing

    from miles.training.megatron.conversion import TE_RENAMES

    sharded = worker._live().gpt.sharded_state_dict()
    for name, entry in sharded.items():
        for local, te in TE_RENAMES.items():
            if entry.key.endswith("." + local):
                sharded[name] = replace(entry, key=entry.key[: -len(local)] + te)
    folder = root / f"iter_{ITERATION:07d}"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"model": sharded, "iteration": ITERATION, "checkpoint_version": 3.0}, str(folder))
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def rank_body(model: str, ckpt: Path, out: Path, role: str) -> dict:
    from miles.training.batch import make_train_batch
    from miles.training.megatron.worker import MegatronWorker

    train, algorithm, rollout = configs(use_kl_loss=True, kl_loss_coef=0.1,
                                        ref_load=str(ckpt) if role == "read" else None)
    worker = MegatronWorker(model, train=train, algorithm=algorithm, rollout=rollout, rank=0, world_size=1,
                            device_type="cpu")
    worker.setup("127.0.0.1", free_port())
    batch = make_train_batch(make_samples(0), worker.pad_id)
    result = {"policy": worker._logprobs(worker._live(), batch)}
    if role == "write":
        write_megatron_checkpoint(worker, ckpt)
    else:
        result["reference"] = worker._logprobs(worker._ref, batch)
        worker.load(str(ckpt))                                 # --load: the policy from the same checkpoint
        result["loaded"] = worker._logprobs(worker._live(), batch)
        result["mask"] = batch.loss_mask
    worker.dispose()
    return result


def run(role: str, model: str, ckpt: Path, out: Path) -> dict:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_rank, args=(role, model, str(ckpt), str(out)))
    proc.start()
    proc.join(RANK_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
    err = out / f"{role}.err"
    assert not err.exists() and proc.exitcode == 0, err.read_text() if err.exists() else proc.exitcode
    return torch.load(out / f"{role}.pt", weights_only=False)


def _rank(role: str, model: str, ckpt: str, out: str) -> None:
    try:
        torch.save(rank_body(model, Path(ckpt), Path(out), role), Path(out) / f"{role}.pt")
    except BaseException:
        (Path(out) / f"{role}.err").write_text(traceback.format_exc())
        raise


def checksum(model: str) -> str:
    from safetensors.torch import load_file

    from miles.weights.checksum import state_dict_checksum

    return state_dict_checksum(load_file(str(Path(model) / "model.safetensors")), dtype=torch.float32)


def other_weights(src: str, dst: Path) -> str:
    """The same architecture as `src`, other weights (what --hf-checkpoint holds in the test)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(dst)
    from tests.tiny_model import _tokenizer
    _tokenizer().save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory):
    """(the HF model it came from, the Megatron-LM checkpoint folder, its weights' logprobs)."""
    root = tmp_path_factory.mktemp("megatron_ckpt")
    source = make_model(root / "source", "qwen2")
    ckpt = root / "Qwen-tiny_torch_dist"
    return source, ckpt, run("write", source, ckpt, root)


def test_a_megatron_torch_dist_checkpoint_loads_as_policy_and_reference_with_its_weights_logprobs(megatron_ckpt,
                                                                                                tmp_path):
    from miles.checkpoint.megatron_format import megatron_checkpoint_info

    source, ckpt, written = megatron_ckpt
    hf = other_weights(source, tmp_path / "hf")
    info = megatron_checkpoint_info(ckpt)
    assert info is not None and info.iteration == ITERATION and info.dist_dir == ckpt / f"iter_{ITERATION:07d}"
    read = run("read", hf, ckpt, tmp_path)
    mask = read["mask"]
    # --hf-checkpoint's own weights give other logprobs: the load is what makes them equal
    assert not torch.allclose(read["policy"][mask], written["policy"][mask], atol=1e-3)
    torch.testing.assert_close(read["reference"][mask], written["policy"][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(read["loaded"][mask], written["policy"][mask], rtol=0, atol=1e-5)


@pytest.mark.ray
def test_a_run_resumes_from_a_miles_iter_folder_at_the_next_iteration(megatron_ckpt, ray_cluster, tiny_task, tmp_path):
    from tests.integration.test_megatron_ray import run as run_training, train_rows
    from miles.runtime import read_trace
    from tests.conftest import base_flags, miles_actors

    source, ckpt, _ = megatron_ckpt
    hf = other_weights(source, tmp_path / "hf")
    result = run_training(base_flags({**tiny_task, "model": hf}, tmp_path / "run", train_backend="megatron",
                                     load=ckpt, num_rollout=ITERATION + 2, device="cpu", global_batch_size=8,
                                     micro_batch_size=4, check_weight_update_equal=True))
    assert result.final_state == "shutdown"
    resumed = read_trace(result.run_dir).of("resumed")[0]
    assert (resumed.get("rollout_id"), resumed.get("next_rollout"), resumed.get("format")) == (
        ITERATION, ITERATION + 1, "megatron_torch_dist")
    # what starts fresh is said, not left to be found out
    assert resumed.get("fresh") == ["optimizer", "lr_schedule", "data_position"]
    assert "optimizer state is not read" in resumed.get("note")
    assert [r["step"] for r in train_rows(result)] == [ITERATION + 1]      # miles: a resumed run starts at loaded+1
    # the engines got the checkpoint's weights (the model it was made from), not --hf-checkpoint's
    first_sync = read_trace(result.run_dir).of("weights_synced")[0].get("checksum")
    assert first_sync == checksum(source) != checksum(hf)
    assert miles_actors() == []
