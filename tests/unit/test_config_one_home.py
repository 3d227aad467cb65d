"""A fact has one home: a RunConfig built in code (miles.Run) gives every component what the CLI's does.

The bug this guards: flags used to copy --rollout-temperature and --rollout-max-response-len into the
algorithm slice and --seed into the rollout slice at parse time; a config built in code skipped the
copy, so its trainer recomputed logprobs at temperature 1.0 whatever the rollout used.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles.config import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.phases.init import trainer_options
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("one-home")
    data = root / "prompts.jsonl"
    data.write_text("".join(f'{{"input": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(4)))
    return make_tiny_model(root / "model"), str(data)


def both_configs(model: str, data: str) -> tuple[RunConfig, RunConfig]:
    cli, _ = parse_flags(["--hf-checkpoint", model, "--prompt-data", data, "--label-key", "label",
                          "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                          "--rollout-temperature", "0.7", "--rollout-max-response-len", "6", "--seed", "5",
                          "--loss-agg-mode", "seq_mean_token_sum_norm", "--lr", "0.01"])
    code = RunConfig(model=ModelConfig(hf_checkpoint=model), data=DataConfig(prompt_data=data, label_key="label"),
                     rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=2, temperature=0.7, max_response_len=6),
                     algorithm=AlgorithmConfig(loss_agg_mode="seq_mean_token_sum_norm"),
                     train=TrainConfig(seed=5, lr=0.01), num_rollout=1)
    return cli, code


def test_code_and_cli_configs_give_the_components_the_same_slices(paths):
    cli, code = both_configs(*paths)
    assert trainer_options(cli) == trainer_options(code)
    assert trainer_options(code)["rollout"].temperature == 0.7
    assert cli.rollout_seed == code.rollout_seed == 5        # --rollout-seed defaults to --seed in both


def samples() -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(4):
        response = [rng.randrange(5, 30) for _ in range(1 + i)]
        out.append(Sample(prompt=Prompt(index=i, text="", prompt_ids=(5, 6 + i)), group=i // 2, response_ids=response,
                          rollout_logprobs=[-1.0] * len(response), finish_reason="stop", weight_version=0,
                          advantage=(-1.0) ** i))
    return out


def test_code_and_cli_configs_train_identically(paths):
    model, _ = paths
    cli, code = both_configs(*paths)
    results = []
    for cfg in (cli, code):
        trainer = Trainer(model, **{**trainer_options(cfg), "device": "cpu"})
        assert trainer._objective.temperature == 0.7
        metrics = trainer.train(samples(), 0)
        for timed in ("step_time_s", "optimizer_step_s", "tflops"):    # wall time and what it gives: may differ
            metrics.pop(timed)
        results.append((metrics, trainer.weights_checksum()))
    assert results[0] == results[1]
