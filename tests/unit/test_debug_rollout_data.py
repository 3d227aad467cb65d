"""Saved rollouts (--save/--load-debug-rollout-data) and the debug flags' machines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from miles.config import ConfigError, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.rollout.debug_data import load_rollout_data, rollout_data_path, save_rollout_data
from miles.types import Prompt, Sample


def sample(group, reward):
    prompt = Prompt(index=3, text="1+2=", prompt_ids=(5, 6, 7, 8), label="3", metadata={"src": "t"})
    return Sample(prompt=prompt, group=group, response_ids=[9, 2], rollout_logprobs=[-0.5, -0.25],
                  finish_reason="stop", weight_version=1, response_text="3", reward=reward, advantage=0.5)


def test_paths_from_a_template_or_a_folder(tmp_path):
    assert rollout_data_path(str(tmp_path / "r{rollout_id}.pt"), 7) == tmp_path / "r7.pt"
    assert rollout_data_path(str(tmp_path / "dump"), 7) == tmp_path / "dump" / "rollout_7.pt"


def test_a_saved_rollout_reads_back_equal(tmp_path):
    samples = [sample(0, 1.0), sample(0, 0.0)]
    path = save_rollout_data(tmp_path / "d" / "rollout_4.pt", 4, samples, {"reward_mean": 0.5, "note": "x",
                                                                         "skipped": [1, 2]})
    got = load_rollout_data(path, expect_rollout_id=4)
    assert got.rollout_id == 4 and got.samples == samples
    assert got.metrics == {"reward_mean": 0.5, "note": "x"}          # only scalars are kept
    assert not list(tmp_path.glob("d/*.tmp"))


def test_the_fast_engines_routing_arrays_are_saved_as_lists_a_weights_only_load_reads(tmp_path):
    s = replace(sample(0, 1.0), rollout_routed_experts=[np.asarray([[1, 2]], np.uint8), []])   # a tool token
    got = load_rollout_data(save_rollout_data(tmp_path / "rollout_0.pt", 0, [s], {}))
    assert got.samples == [replace(s, rollout_routed_experts=[[[1, 2]], []])]


def test_missing_foreign_or_misnumbered_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no saved rollout at .*rollout_0.pt"):
        load_rollout_data(tmp_path / "rollout_0.pt")
    import torch
    torch.save({"something": "else"}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="not a rollout saved by miles"):
        load_rollout_data(tmp_path / "other.pt")
    save_rollout_data(tmp_path / "rollout_1.pt", 1, [sample(0, 1.0)], {})
    with pytest.raises(ConfigError, match="holds rollout 1, not 2"):
        load_rollout_data(tmp_path / "rollout_1.pt", expect_rollout_id=2)


def cfg(**run):
    return RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p"),
                     rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), **run)


def test_debug_flags_pick_their_machine_and_refuse_others():
    from miles.config.validate import validate
    from miles.phases.debug import debug_machine
    from miles.runtime.machine import load_machine

    def check_debug_flags(config, machine):        # the registry's checks that take the machine
        validate(config, machine=load_machine(machine))

    assert debug_machine(cfg()) is None
    assert debug_machine(cfg(load_debug_rollout_data="d")) == "train_only"
    assert debug_machine(cfg(debug_rollout_only=True)) == "rollout_only"
    check_debug_flags(cfg(load_debug_rollout_data="d"), "train_only")
    check_debug_flags(cfg(), "sync")
    with pytest.raises(ConfigError, match="runs on --machine train_only, not 'sync'"):
        check_debug_flags(cfg(load_debug_rollout_data="d"), "sync")
    with pytest.raises(ConfigError, match="--machine rollout_only needs --debug-rollout-only"):
        check_debug_flags(cfg(), "rollout_only")
    both = cfg(load_debug_rollout_data="d", debug_rollout_only=True)
    with pytest.raises(ConfigError, match="exclude each other"):
        check_debug_flags(both, "train_only")
    with pytest.raises(ConfigError, match="not supported by --machine async"):
        check_debug_flags(cfg(save_debug_rollout_data="d"), "async")
    check_debug_flags(cfg(save_debug_rollout_data="d"), "sync")
    no_trainer = replace(cfg(debug_rollout_only=True), checkpoint=replace(cfg().checkpoint, save="ck"))
    with pytest.raises(ConfigError, match="no trainer to --save or --load"):
        check_debug_flags(no_trainer, "rollout_only")
