"""Every recipe end to end on real parts (local Ray, embedded engine, torch trainer, tiny model).

The task: the reward is the number of "1"s in the response (a dense reward: every group has spread).
A recipe works when, after 3 rollouts, the trained policy gives the all-"1" response a higher
log-probability than the initial model did, by more than a nat on average over the first training
prompts: a property of the whole distribution, so it does not hinge on which responses were sampled
(the recipes move it by 5 to 10 nats). SFT: its loss falls.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from miles.checkpoint.store import CheckpointStore
from miles.cli.train import main as train_main
from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import read_trace, with_disposer
from miles.metrics.jsonl import read_metrics
from tests.conftest import base_flags

pytestmark = pytest.mark.ray

REWARD = "def ones(prompt, response, label):\n    return float(response.count('1'))\n"
FILTER = "miles.rollout.filters:check_reward_nonzero_std"

RECIPES = {
    # name: extra flags (docs/algorithms.md has a row for each)
    "grpo_tis_kl_loss": dict(advantage_estimator="grpo", use_tis=True, tis_clip=2.0, use_kl_loss=True,
                             kl_loss_coef=0.01, kl_loss_type="low_var_kl"),
    "dr_grpo": dict(advantage_estimator="grpo", disable_grpo_std_normalization=True,
                    loss_agg_mode="seq_mean_token_sum_norm"),
    "gspo": dict(advantage_estimator="gspo", loss_agg_mode="seq_mean_token_mean", eps_clip=3e-4, eps_clip_high=4e-4),
    "dapo_rloo": dict(advantage_estimator="rloo", eps_clip_high=0.28, dynamic_sampling_filter_path=FILTER,
                      over_sampling_batch_size=4, overlong_buffer_len=2, overlong_penalty_factor=0.1),
    "reinforce_plus_plus": dict(advantage_estimator="reinforce_plus_plus", kl_coef=0.01),
    "reinforce_plus_plus_baseline": dict(advantage_estimator="reinforce_plus_plus_baseline", use_kl_loss=True,
                                         kl_loss_coef=0.01, ref_update_interval=2, eps_clip_c=3.0),
    "ppo": dict(advantage_estimator="ppo", normalize_advantages=True, gamma=1.0, lambd=0.95, value_clip=0.2,
                critic_lr=1e-2),
}


def run(argv):
    cfg, machine = parse_flags(argv)
    return asyncio.run(with_disposer(train, cfg, machine=machine or "sync"))


def all_ones_logprob(model_dir: str, prompts: list[str]) -> torch.Tensor:
    """log p("1111" | prompt) for each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for text in prompts:
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        target = tok("1111", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + target])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        out.append(sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(target)))
    return torch.tensor(out)


@pytest.fixture(scope="module")
def ones_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "ones_reward.py"
    path.write_text(REWARD)
    return f"{path}:ones"


# CI runs the recipes that cover the most code (TIS + KL loss, PPO's critic, GSPO's sequence ratio);
# the rest are extended (bash scripts/test.sh -m extended)
CI_RECIPES = {"grpo_tis_kl_loss", "ppo", "gspo"}


@pytest.mark.parametrize("recipe", [r if r in CI_RECIPES else pytest.param(r, marks=pytest.mark.extended)
                                    for r in RECIPES])
def test_recipe_makes_rewarded_responses_more_likely(recipe, ray_cluster, tiny_task, ones_reward, tmp_path):
    torch.set_num_threads(1)
    train_prompts = [json.loads(x)["input"] for x in open(tiny_task["train"]).read().splitlines()[:8]]
    result = run(base_flags(tiny_task, tmp_path / "run", custom_rm_path=ones_reward, lr=1e-2, num_rollout=3,
                            save=tmp_path / "ckpt", rollout_shuffle=False, rollout_batch_size=4,
                            **RECIPES[recipe]))
    assert result.final_state == "shutdown"
    rows = [r for r in result.metrics if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "logprob_diff_rollout", "train_rollout_k3_kl", "grad_norm"):
        assert key in rows[0], key
    final = CheckpointStore(tmp_path / "ckpt").latest()[1] / "hf"
    before, after = all_ones_logprob(tiny_task["model"], train_prompts), all_ones_logprob(str(final), train_prompts)
    assert (after - before).mean() > 1.0, (recipe, before.tolist(), after.tolist())
    check_recipe_metrics(recipe, rows, result)


def check_recipe_metrics(recipe: str, rows: list[dict], result) -> None:
    if recipe == "grpo_tis_kl_loss":
        assert all("tis_weight_mean" in r for r in rows) and rows[-1]["kl"] > 0
    if recipe == "dapo_rloo":
        assert all(r["dynamic_sampling_rounds"] >= 1 and r["zero_std_group_ratio"] == 0 for r in rows)
    if recipe == "reinforce_plus_plus":
        assert rows[0]["reward_kl"] == 0 and rows[-1]["reward_kl"] != 0
    if recipe == "reinforce_plus_plus_baseline":
        assert [r.get("ref_updated", 0) for r in rows] == [0, 1, 0]
    if recipe == "ppo":
        assert all(r["actor_trained"] == 1 for r in rows)
        # a fresh head values everything at 0; it learns the (positive) returns
        assert rows[0]["critic/values_mean"] == 0 and rows[-1]["critic/values_mean"] > 0
        assert "critic" in {e.get("resource") for e in read_trace(result.run_dir).of("disposed")}
        assert (CheckpointStore(result.run_dir.parent / "ckpt").latest()[1] / "critic").is_dir()


def test_sft_trains_on_the_data_responses_through_the_same_machine(ray_cluster, tiny_task, tmp_path, capsys):
    # through the CLI, whose progress lines show SFT's numbers (loss, tokens trained), not RL's
    torch.set_num_threads(1)
    rows = [json.loads(x) for x in open(tiny_task["train"]).read().splitlines()]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"input": r["input"], "response": r["label"]}) + "\n" for r in rows))
    code = train_main(base_flags({**tiny_task, "train": str(sft)}, tmp_path / "run", loss_type="sft_loss",
                                 n_samples_per_prompt=1, rollout_batch_size=16, lr=1e-2, num_rollout=4,
                                 eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=4))
    err = capsys.readouterr().err
    assert code == 0, err
    metrics = read_metrics(tmp_path / "run")
    losses = [r["loss"] for r in metrics if r.get("kind") == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    evals = [r for r in metrics if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 4]       # the engines serve the SFT'd weights to eval
    lines = [l for l in err.splitlines() if l.startswith("miles: rollout ")]
    assert len(lines) == 4 and all(" loss=" in l and " tokens=" in l and "train tok/s=" in l for l in lines), lines
    assert not any("reward=" in l or "kl=" in l for l in lines)
    tokens = [int(l.split("tokens=")[1].split()[0]) for l in lines]
    assert all(a < b for a, b in zip(tokens, tokens[1:])), lines                # trained so far: it grows


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
def test_critic_warm_up_saves_only_the_critic_and_a_later_run_starts_from_it(ray_cluster, tiny_task, ones_reward,
                                                                              tmp_path):
    torch.set_num_threads(1)
    ppo = dict(advantage_estimator="ppo", custom_rm_path=ones_reward, lr=1e-2, rollout_batch_size=4)
    warm = run(base_flags(tiny_task, tmp_path / "warm", num_rollout=2, num_critic_only_steps=2,
                          critic_save=tmp_path / "critic", save_interval=1, check_weight_update_equal=True, **ppo))
    rows = [r for r in warm.metrics if r.get("kind") == "train"]
    assert [r["actor_trained"] for r in rows] == [0, 0] and "pg_loss" not in rows[0]
    assert [rid for rid, _ in CheckpointStore(tmp_path / "critic").list()] == [0, 1]
    assert (CheckpointStore(tmp_path / "critic").latest()[1] / "critic" / "value_head.safetensors").is_file()
    # the policy never stepped: every weight sync carried the initial weights
    checksums = [e.get("checksum") for e in read_trace(warm.run_dir).of("weights_synced")]
    assert len(checksums) == 3 and len(set(checksums)) == 1
    main = run(base_flags(tiny_task, tmp_path / "main", num_rollout=1, critic_load=tmp_path / "critic", **ppo))
    first = [r for r in main.metrics if r.get("kind") == "train"][0]
    assert first["critic/values_mean"] != 0 and first["actor_trained"] == 1   # a fresh head would value 0


@pytest.mark.extended   # out of the default run (CI budget): PPO's recipe on one rank here, the critic's two ranks in tests/unit/test_fsdp_critic.py
def test_ppo_with_the_policy_and_the_critic_on_two_ranks(ray_cluster, tiny_task, ones_reward, tmp_path):
    """--actor-num-gpus-per-node 2 on the CPU: the policy and PPO's critic each run as 2 FSDP ranks
    (gloo); the critic learns, and its checkpoint is the one-process critic's folder."""
    from miles.config import AlgorithmConfig, TrainConfig
    from miles.training.torch.critic import Critic

    torch.set_num_threads(1)
    result = run(base_flags(tiny_task, tmp_path / "run", custom_rm_path=ones_reward, lr=1e-2, num_rollout=2,
                            save=tmp_path / "ckpt", rollout_batch_size=4, actor_num_gpus_per_node=2,
                            **RECIPES["ppo"]))
    assert result.final_state == "shutdown"
    rows = [r for r in result.metrics if r.get("kind") == "train"]
    assert [r["actor_trained"] for r in rows] == [1, 1]
    assert rows[0]["critic/values_mean"] == 0 and rows[-1]["critic/values_mean"] > 0
    assert all(r["critic/num_steps"] >= 1 and r["critic/grad_norm"] > 0 for r in rows)
    ready = [json.loads(line) for line in (result.run_dir / "logs" / "critic-0.jsonl").open()
             if '"critic_ready"' in line]
    assert [r.get("ranks") for r in ready] == [2]
    assert "critic" in {e.get("resource") for e in read_trace(result.run_dir).of("disposed")}   # and its ranks
    critic = Critic(tiny_task["model"], train=TrainConfig(lr=1e-2), device="cpu",
                    algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                    init_from=str(tmp_path / "ckpt"))      # the newest checkpoint's critic/, on one process
    assert critic.num_steps == sum(r["critic/num_steps"] for r in rows)


@pytest.mark.extended   # the resume path of the test above, end to end (bash scripts/test.sh -m extended)
def test_ppo_on_two_ranks_resumes_its_policy_and_critic_on_two_ranks(ray_cluster, tiny_task, ones_reward, tmp_path):
    torch.set_num_threads(1)
    flags = dict(custom_rm_path=ones_reward, lr=1e-2, save=tmp_path / "ckpt", rollout_batch_size=4,
                 actor_num_gpus_per_node=2, save_interval=1, **RECIPES["ppo"])
    first = run(base_flags(tiny_task, tmp_path / "first", num_rollout=1, **flags))
    resumed = run(base_flags(tiny_task, tmp_path / "resumed", num_rollout=2, load=tmp_path / "ckpt", **flags))
    assert first.final_state == resumed.final_state == "shutdown"
    rows = [r for r in resumed.metrics if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["critic/values_mean"] != 0        # the critic came back trained: a fresh head values 0
