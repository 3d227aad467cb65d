"""Benchmark (GPU machine, not a test): one GRPO iteration of `miles train --device cuda` against TRL's
GRPOTrainer step, same model, data, batch, reward and GPU, in one run.

The setup: a random Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151,936, tied embeddings, bf16) with a character tokenizer; 32 prompts of
64 characters x 8 samples x 256 new tokens; micro-batch 64, global batch 256 (one optimizer step
per rollout); the reward is a file loaded by both (`--custom-rm-path reward.py:reward` for miles).
Each side runs in its own subprocess, bounded in time, while `nvidia-smi` is sampled for the GPU
memory in use.

Printed JSON, the ratios first:
  ratios          TRL's steady step time / miles' steady iteration time (and the same for the first)
  miles           per-iteration times (between successive weight_sync starts), per-phase times
                  (rollout, weight_sync, train) from the trace, the weight sync's own duration,
                  train MFU, peak GPU memory per iteration and overall
  trl             per-step times (a step generates and trains one global batch), MFU of the whole step,
                  the generate + score part of each step (generate_s: the rest of a step is its training)
MFU counts 6 x params x tokens for forward + backward and 2 x params x tokens for each no-grad logprob
pass the trainer runs (1 unless the trainer's metrics say it skipped it), against the H200's dense
bf16 peak of 989 TFLOP/s (the vendor's datasheet; the same as the H100 SXM). params counts the tied
embedding once; tokens are prompt + response tokens of the 256 samples.

`--model-family qwen3 --size 1.7b` builds a Qwen3-1.7B-shaped model instead (`Qwen3ForCausalLM`, hidden
2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab 151,936, tied, bf16);
its default miles flags add activation recomputation and a smaller token budget per micro-batch (the
trainer of a 1.7B model at 1,024 new tokens shares the GPU with the engine). Its measurement:
  python3 scripts/bench/grpo_step_gpu.py --model-family qwen3 --size 1.7b --new-tokens 1024 --skip-trl

The small end, on the CPU (the embedded default the demo runs; TRL installed beside the project):
  python3 scripts/bench/grpo_step_gpu.py --device cpu --model examples/arithmetic/base_model \
      --task arithmetic --new-tokens 6 --miles-flags "" [--miles-iters 6 --trl-steps 6] [--trl-site DIR]
TRL's stack in a folder of its own, so that nothing of the project's environment changes (torch,
transformers and pyarrow stay the environment's; dill 0.4.1, as datasets' fingerprinting pickles a
pyarrow type that dill 0.3.8 cannot on Python 3.11):
  pip install --no-deps --target DIR trl==1.16.0 datasets==5.2.0 accelerate==1.16.0 dill==0.4.1 \
      multiprocess==0.70.19 xxhash pandas python-dateutil pytz tzdata

Usage (on the GPU machine, from the checkout, after installing the .whl wheels):
  PYTHONPATH=$PWD python3 scripts/bench/grpo_step_gpu.py [--miles-iters 6] [--trl-steps 4]
      [--model-family qwen2|qwen3] [--size 0.5b|0.6b|1.7b|4b|8b]
      [--miles-flags "--colocate ..."] [--skip-trl] [--out DIR]
      [--trl-dtype bfloat16] [--trl-micro-batch N] [--trl-timeout-s S]
TRL is skipped (with a note in the JSON) when it cannot be imported. Its worker writes its result after
every step (and every generation), so a side its bound cuts still reports the steps it finished, with
its log's tail. On an MoE model (a config with `output_router_logits`) TRL's load-balancing loss is
turned off (`router_aux_loss_coef=0.0`): miles' side trains without one unless its flags add it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

def _shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, *, head_dim: int | None = None,
           tied: bool = True, context: int = 4096) -> dict:
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 intermediate_size=intermediate, vocab_size=151936, tie_word_embeddings=tied,
                 max_position_embeddings=context, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    return shape | ({"head_dim": head_dim} if head_dim else {})


SHAPES = {   # (--model-family, --size) -> the HF config's shape (random init), the released models' sizes
    ("qwen2", "0.5b"): _shape(896, 24, 14, 2, 4864),
    ("qwen3", "1.7b"): _shape(2048, 28, 16, 8, 6144, head_dim=128),
    # with Qwen3's 40,960-token context for the long-answer workloads
    ("qwen3", "0.6b"): _shape(1024, 28, 16, 8, 3072, head_dim=128, context=40960),
    ("qwen3", "4b"): _shape(2560, 36, 32, 8, 9728, head_dim=128, context=40960),
    ("qwen3", "8b"): _shape(4096, 36, 32, 8, 12288, head_dim=128, tied=False, context=40960),
}
SHAPE = SHAPES[("qwen2", "0.5b")]
PEAK_TFLOPS = 989.0            # H200 SXM dense bf16, vendor datasheet (= H100 SXM)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = "".join(chr(c) for c in range(32, 127))   # printable ASCII, space included
PROMPT_CHARS = 64
PREAMBLE = "Add the two numbers and answer with digits only, please. "
REWARD_SOURCE = '''"""The benchmark's reward: the share of digits in the response (a number in [0, 1] with spread)."""


def score(text):
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def reward(prompt, response, label):          # miles: --custom-rm-path reward.py:reward
    return score(response)


def trl_reward(prompts, completions, **kwargs):   # TRL: reward_funcs=[trl_reward]
    return [score(c) for c in completions]
'''
# the fastest configuration miles has; override with --miles-flags
MILES_FLAGS = "--colocate --rollout-engine fast --use-dynamic-batch-size --max-tokens-per-gpu 32768"
MILES_FLAGS_LARGE = ("--colocate --rollout-engine fast --use-dynamic-batch-size --max-tokens-per-gpu 16384 "
                     "--recompute-activations")


# --- inputs ---------------------------------------------------------------------------------------
def build_tokenizer(folder: Path, shape: dict = SHAPE):
    """One token per printable ASCII character. Byte-level symbols ("Ġ" for the space) in a BPE without
    merges, as in tests/tiny_model.py: transformers loads a qwen2 folder's tokenizer through
    Qwen2Tokenizer, which drops a plain " " entry."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(ALPHABET.replace(" ", "Ġ")))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left", model_max_length=shape["max_position_embeddings"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)


def build_model(folder: Path, family: str = "qwen2", size: str = "0.5b", shape: dict | None = None,
                isolated: bool | None = None) -> int:
    """The random bf16 model and its tokenizer in `folder` (`shape`: instead of the size's); returns the
    parameter count (tied once).

    `isolated` (by default where CUDA is): built in a child process, so that nothing of it stays in this
    one while the runs it starts train. Built here, the model's trip through host memory to be written
    (16 GB at the 30b-a3b-12l shape) stayed in this process's resident memory (14.3 GB on an H200, Dec 7
    2026: glibc keeps what was freed), and so did a CUDA context on the GPU the runs share; the trainer's
    host memory beside it (AdamW's moments under --offload-train) then went past the 128 GiB machine's
    and Ray's OOM killer ended the run."""
    if isolated is None:
        import torch

        isolated = torch.cuda.is_available()
    if not isolated:
        return _build_model(folder, family, size, shape)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_build_model, folder, family, size, shape).result()


def _build_model(folder: Path, family: str, size: str, shape: dict | None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    folder.mkdir(parents=True, exist_ok=True)
    shape = shape or SHAPES[(family, size)]
    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[family]
    cfg = config_cls(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    torch.manual_seed(0)
    # made in bf16 (an 8B model is 16 GB, not 32), on the GPU where there is one (a CPU initialises 8B
    # parameters in minutes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer(folder, shape)
    tok = AutoTokenizer.from_pretrained(folder)
    probe = PREAMBLE + "12+34="
    if tok.decode(tok(probe, add_special_tokens=False).input_ids) != probe:
        raise SystemExit("the character tokenizer does not round-trip on this transformers version")
    params = sum(p.numel() for p in model.parameters())     # parameters() lists a tied weight once
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def count_params(folder: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())


def active_params(folder: Path) -> tuple[int, int]:
    """(all parameters, those one token's forward multiplies by) of the model in `folder`, built on the
    meta device. A mixture-of-experts layer's experts (`.mlp.experts.` tensors, E experts stacked on the
    first axis) count k / E of theirs, k = num_experts_per_tok; the rest counts whole as the dense MFU
    formula counts it (an untied embedding and lm_head both). A dense model: (n, n)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        experts += p.numel() if ".mlp.experts." in name else 0
    k, e = getattr(cfg, "num_experts_per_tok", None), getattr(cfg, "num_experts", None)
    return total, total if not experts else total - experts + experts * k // e


ARITHMETIC_REWARD_SOURCE = '''"""The arithmetic demo's reward: 1 for the exact sum, else 0."""


def reward(prompt, response, label):
    return float(response.strip() == label)


def trl_reward(prompts, completions, label, **kwargs):
    return [float(c.strip() == y) for c, y in zip(completions, label)]
'''


def write_data(root: Path, n_prompts: int, task: str = "digits") -> tuple[Path, Path, float]:
    """The prompts file, the reward file and the prompts' mean length in tokens (characters)."""
    import random

    path = root / "prompts.jsonl"
    if task == "arithmetic":        # the CPU demo's own prompts (examples/arithmetic), short answers
        rows = [json.loads(line) for line in (ROOT / "examples/arithmetic/data/train.jsonl").open()][:n_prompts]
        path.write_text("".join(json.dumps({"input": r["input"], "prompt": r["input"], "label": r["label"]}) + "\n"
                                for r in rows))
        (root / "reward.py").write_text(ARITHMETIC_REWARD_SOURCE)
        return path, root / "reward.py", statistics.fmean(len(r["input"]) for r in rows)
    r = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n_prompts):
            a, b = r.randint(10, 99), r.randint(10, 99)
            text = (PREAMBLE + f"{a}+{b}=").rjust(PROMPT_CHARS)       # every prompt PROMPT_CHARS tokens
            f.write(json.dumps({"input": text, "prompt": text, "label": str(a + b)}) + "\n")
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    return path, reward, float(PROMPT_CHARS)


# --- GPU memory, sampled from outside the processes -----------------------------------------------
class MemorySampler:
    """`nvidia-smi`'s memory.used (MiB, all processes, GPU 0) every `period_s`, with wall-clock times."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.samples = period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return                       # no nvidia-smi: no samples, the JSON says null
            self._stop.wait(self.period_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def peak_mib(self, start: float | None = None, end: float | None = None) -> float | None:
        vals = [m for t, m in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return max(vals) if vals else None


class _Stopped(Exception):
    """SIGTERM reached this script (an outer `timeout`): end the running side as if its bound had passed."""


_stopped: list[int] = []         # the signal, once one came: later sides do not start


def _on_sigterm(signum, frame) -> None:
    _stopped.append(signum)
    raise _Stopped()


def run_bounded(cmd: list[str], *, timeout_s: float, log: Path, env: dict | None = None) -> dict:
    """Run `cmd` (its own process group) with output to `log`; past the timeout, or when this script
    gets SIGTERM, SIGTERM the group, then SIGKILL it 60 s later (a group of its own does not get the
    outer `timeout`'s signal: without this a killed bench left its miles run holding the GPU).
    Returns the exit status, wall time and whether it timed out (or was stopped)."""
    if _stopped:
        return {"rc": None, "wall_s": 0.0, "timed_out": True, "stopped": "SIGTERM before it started", "log": str(log)}
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout_s), False
        except (subprocess.TimeoutExpired, _Stopped):
            timed_out = True
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second signal must not cut the clean-up short
            os.killpg(proc.pid, signal.SIGTERM)       # miles tears down on SIGTERM; TRL just exits
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    out = {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "timed_out": timed_out, "log": str(log)}
    if _stopped:
        out["stopped"] = "SIGTERM"
    return out


def tail(path: str, n: int = 30) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


# --- TRL ------------------------------------------------------------------------------------------
def trl_worker(model: str, prompts: str, reward: str, out: str, steps: int, a: argparse.Namespace) -> None:
    """Runs inside its own process: TRL's GRPOTrainer for `steps` steps, step times and peak memory to `out`."""
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_reward", reward)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [json.loads(line) for line in open(prompts)]
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows] * (steps + 1))
    times, records, dump_steps = [], [], []

    cuda = torch.cuda.is_available()         # CPU only for a smoke test of this script
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            times.append([time.monotonic(), None])

        def on_step_end(self, args, state, control, **kw):
            sync()
            times[-1][1] = time.monotonic()
            for write in dump_steps:
                write()

        def on_log(self, args, state, control, logs=None, **kw):
            records.append(dict(logs or {}))

    micro = a.trl_micro_batch or a.micro_batch
    extra = {}
    if a.trl_dtype:         # TRL loads the policy in float32 unless told (its create_model_from_path)
        extra["model_init_kwargs"] = {"dtype": a.trl_dtype}
    if hasattr(AutoConfig.from_pretrained(model), "output_router_logits"):
        # an MoE model: TRL adds the config's load-balancing loss (router_aux_loss_coef) unless told; the
        # miles side trains without one (--moe-aux-loss-coeff 0), so neither does
        extra["router_aux_loss_coef"] = 0.0
    config = GRPOConfig(output_dir=str(Path(out).parent / "trl-out"), per_device_train_batch_size=micro,
                        gradient_accumulation_steps=a.global_batch // micro, num_generations=a.samples,
                        max_completion_length=a.new_tokens, temperature=1.0, num_iterations=1, beta=0.0,
                        learning_rate=1e-6, max_steps=steps, logging_steps=1, save_strategy="no", report_to=[],
                        bf16=cuda, seed=0, shuffle_dataset=True, use_cpu=not cuda, **extra)
    trainer = GRPOTrainer(model=model, reward_funcs=[module.trl_reward], args=config, train_dataset=data,
                          callbacks=[Clock()])
    generate_s = []         # TRL's generate + score of each step (its _generate_and_score_completions)
    inner = getattr(trainer, "_generate_and_score_completions", None)
    if inner is not None:
        def timed(*args, **kwargs):
            sync()
            t0 = time.monotonic()
            out = inner(*args, **kwargs)
            sync()
            generate_s.append(round(time.monotonic() - t0, 4))
            for write in dump_steps:        # a step cut by the bound after its generation keeps that part
                write()
            return out
        trainer._generate_and_score_completions = timed
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dump_steps.append(lambda: dump(out, times, records, generate_s, config, micro, trainer, cuda))
    trainer.train()
    dump(out, times, records, generate_s, config, micro, trainer, cuda)


def dump(out: str, times: list, records: list, generate_s: list, config, micro: int, trainer, cuda: bool) -> None:
    """The TRL side's result so far to `out` (after every step: a side cut by its bound keeps its finished steps)."""
    import torch

    step_s = [round(e - s, 4) for s, e in times if e is not None]
    lengths = [x["completions/mean_length"] for x in records if "completions/mean_length" in x]
    Path(out).write_text(json.dumps({
        "step_s": step_s, "generate_s": generate_s, "completion_len_mean": lengths,
        "torch_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 3) if cuda else None,
        "config": {"gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16,
                   "per_device_train_batch_size": micro, "gradient_accumulation_steps": config.gradient_accumulation_steps,
                   "generation_batch_size": config.generation_batch_size, "loss_type": config.loss_type,
                   "router_aux_loss_coef": getattr(config, "router_aux_loss_coef", None),
                   "model_dtype": str(next(trainer.model.parameters()).dtype)}}))


def trl_env(site: Path | None) -> dict | None:
    """The TRL worker's environment: with --trl-site, that folder first on its path (and only on its:
    miles' side never sees the TRL stack's packages)."""
    if site is None:
        return None
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))


def run_trl(a: argparse.Namespace, root: Path, model: Path, prompts: Path, reward: Path, params: int) -> dict:
    env = trl_env(a.trl_site)
    probe = subprocess.run([sys.executable, "-c", "import trl"], env=env, capture_output=True, text=True)
    if probe.returncode:
        return {"skipped": f"trl is not importable: {probe.stderr.strip().splitlines()[-1:]}"}
    out = root / "trl.json"
    out.unlink(missing_ok=True)         # an earlier call's, in a kept --out
    cmd = [sys.executable, __file__, "--trl-worker", str(model), str(prompts), str(reward), str(out),
           "--trl-steps", str(a.trl_steps), "--micro-batch", str(a.micro_batch), "--global-batch",
           str(a.global_batch), "--samples", str(a.samples), "--new-tokens", str(a.new_tokens),
           *(["--trl-dtype", a.trl_dtype] if a.trl_dtype else []),
           *(["--trl-micro-batch", str(a.trl_micro_batch)] if a.trl_micro_batch else [])]
    with MemorySampler() as mem:
        run = run_bounded(cmd, timeout_s=a.trl_timeout_s or a.side_timeout_s, log=root / "trl.log", env=env)
    if not out.is_file():
        return {"error": "TRL wrote no result", **run, "log_tail": tail(run["log"])}
    res = json.loads(out.read_text())
    if run["rc"] != 0:          # cut by its bound or failed after some steps: what it finished, and why
        res["log_tail"] = tail(run["log"])
    steps = res["step_s"]
    steady = statistics.median(steps[1:]) if len(steps) > 1 else (steps[0] if steps else None)
    lengths = res["completion_len_mean"]
    tokens = a.prompts * a.samples * (a.prompt_tokens + (statistics.fmean(lengths) if lengths else a.new_tokens))
    mfu = 6 * params * tokens / (steady * PEAK_TFLOPS * 1e12) if steady else None
    gen = res.get("generate_s") or []
    return {"steady_step_s": steady, "first_step_s": steps[0] if steps else None, "step_s": steps,
            "steady_generate_s": statistics.median(gen[1:]) if len(gen) > 1 else None,
            "median_step_s": statistics.median(steps) if steps else None,
            "mfu_whole_step": round(mfu, 4) if mfu else None, "tokens_per_step": round(tokens),
            "gpu_mem_peak_mib": mem.peak_mib(), **{k: v for k, v in res.items() if k != "step_s"}, "run": run}


# --- miles ----------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass                             # a line cut by a kill
    return out


def epoch(ts: str) -> float:
    return datetime.fromisoformat(ts).timestamp()


def miles_iterations(trace: list[dict]) -> list[dict]:
    """One entry per weight_sync -> rollout -> train cycle that finished its train phase."""
    iters, current = [], None
    for e in trace:
        if e.get("event") == "phase_start" and e.get("state") == "weight_sync":
            current = {"start": epoch(e["ts"]), "start_mono": e["mono"], "phases": {}}
        elif e.get("event") == "phase_end" and current is not None and e.get("state") in ("weight_sync", "rollout",
                                                                                           "train"):
            current["phases"][e["state"]] = e["duration_s"]
            if e["state"] == "train":
                current["end"], current["end_mono"] = epoch(e["ts"]), e["mono"]
                iters.append(current)
                current = None
        elif e.get("event") == "weights_synced" and current is not None:
            current["sync_s"] = e.get("duration_s")
        elif e.get("event") in ("memory_to_engines", "memory_to_trainer") and current is not None:
            current[e["event"] + "_s"] = e.get("duration_s")
    return iters


def _spread(values: list) -> float | None:
    """max / min of the per-iteration values (1.05 = within 5%), None without samples."""
    vals = [v for v in values if v]
    return round(max(vals) / min(vals), 4) if vals else None


def summarize_miles(run_dir: Path, mem: MemorySampler, params: int, a: argparse.Namespace) -> dict:
    iters = miles_iterations(read_jsonl(run_dir / "trace.jsonl"))
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("kind") == "train" or "train_time_s" in m]
    if not iters:
        return {"error": "no complete iteration in the trace"}
    # an iteration's time: from its weight_sync start to the next one's (the last: to its train end)
    starts = [it["start_mono"] for it in iters]
    iter_s = [round(b - s, 4) for s, b in zip(starts, starts[1:])] + [round(iters[-1]["end_mono"] - starts[-1], 4)]
    phase = {p: [round(it["phases"].get(p, 0.0), 4) for it in iters] for p in ("weight_sync", "rollout", "train")}
    mfu = []
    for it, m in zip(iters, metrics):
        tokens = a.prompts * a.samples * a.prompt_tokens + m.get("gen_tokens", a.prompts * a.samples * a.new_tokens)
        passes = m.get("logprob_passes", 1.0)       # no-grad logprob passes the trainer ran (0 when skipped)
        mfu.append(round((6 + 2 * passes) * params * tokens / (it["phases"]["train"] * PEAK_TFLOPS * 1e12), 4))
    steady = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else xs[0]   # noqa: E731
    peaks = [mem.peak_mib(it["start"], it["end"]) for it in iters]
    return {"steady_iteration_s": steady(iter_s), "first_iteration_s": iter_s[0], "iteration_s": iter_s,
            "phase_s": phase, "steady_phase_s": {p: steady(v) for p, v in phase.items()},
            "weight_sync_s": [it.get("sync_s") for it in iters],
            "memory_handoff_s": {k: [it.get(k + "_s") for it in iters] for k in ("memory_to_trainer", "memory_to_engines")},
            "train_mfu": mfu, "steady_train_mfu": steady(mfu) if mfu else None,
            "gpu_mem_peak_mib_per_iteration": peaks, "gpu_mem_peak_mib": mem.peak_mib(),
            "trainer_gpu_mem_peak_gib": [round(m["gpu_mem_peak_gib"], 3) for m in metrics if "gpu_mem_peak_gib" in m],
            "gpu_mem_peak_max_over_min": _spread(peaks),
            "logprob_passes": [m.get("logprob_passes") for m in metrics],
            "trainer_metrics_last": {k: v for k, v in (metrics[-1] if metrics else {}).items()
                                     if isinstance(v, (int, float))}}


def run_miles(a: argparse.Namespace, root: Path, model: Path, prompts: Path, reward: Path, params: int) -> dict:
    run_dir = root / "miles-run"
    shutil.rmtree(run_dir, ignore_errors=True)          # a kept --out from an earlier run: start clean
    cmd = [sys.executable, "-m", "miles.cli", "train", "--device", a.device, "--hf-checkpoint", str(model),
           "--prompt-data", str(prompts), "--input-key", "input", "--label-key", "label",
           "--custom-rm-path", f"{reward}:reward", "--rollout-batch-size", str(a.prompts),
           "--n-samples-per-prompt", str(a.samples), "--rollout-max-response-len", str(a.new_tokens),
           "--rollout-temperature", "1.0", "--global-batch-size", str(a.global_batch),
           "--micro-batch-size", str(a.micro_batch), "--num-rollout", str(a.miles_iters), "--lr", "1e-6",
           "--run-dir", str(run_dir), "--trace-console", "off", "--progress", "off",
           *shlex.split(a.miles_flags)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with MemorySampler() as mem:
        run = run_bounded(cmd, timeout_s=a.side_timeout_s, log=root / "miles.log", env=env)
    out = summarize_miles(run_dir, mem, params, a)
    out.update(flags=a.miles_flags, command=shlex.join(cmd), run=run)
    if run["rc"] != 0:
        out["log_tail"] = tail(run["log"])
    return out


# --- main -----------------------------------------------------------------------------------------
def ratios(miles: dict, trl: dict) -> dict:
    if "steady_iteration_s" not in miles or not trl.get("steady_step_s"):
        return {"note": "one side has no result; see below"}
    return {"trl_step_over_miles_iteration_steady": round(trl["steady_step_s"] / miles["steady_iteration_s"], 3),
            "trl_step_over_miles_iteration_first": round(trl["first_step_s"] / miles["first_iteration_s"], 3),
            "goal": ">= 5"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="keep the model, data, logs and runs here (default: temp)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--miles-iters", type=int, default=6, help="miles rollouts (the first warms up)")
    p.add_argument("--trl-steps", type=int, default=4, help="TRL steps (the first warms up)")
    p.add_argument("--model-family", choices=sorted({f for f, _ in SHAPES}), default="qwen2")
    p.add_argument("--size", choices=sorted({s for _, s in SHAPES}), default=None,
                   help="the family's shape (default: its first: qwen2 0.5b, qwen3 1.7b; qwen3 also 0.6b, 4b, 8b)")
    p.add_argument("--miles-flags", default=None,
                   help=f"extra miles flags (default: {MILES_FLAGS!r}; at 1.7b {MILES_FLAGS_LARGE!r})")
    p.add_argument("--side-timeout-s", type=float, default=210.0, help="wall-clock bound of each side")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--trl-site", type=Path, default=None,
                   help="a folder TRL and its data stack were installed into (pip install --target), put on the "
                        "TRL side's path only (see the module docstring)")
    p.add_argument("--device", default="cuda", help="miles' --device (cpu: a smoke test of this script only)")
    p.add_argument("--model", type=Path, default=None,
                   help="use this HF folder instead of building the 0.5B-shaped one (a smoke test)")
    p.add_argument("--skip-miles", action="store_true")
    p.add_argument("--task", choices=("digits", "arithmetic"), default="digits",
                   help="digits: 64-character prompts, the reward is the share of digits (the GPU shapes); "
                        "arithmetic: the CPU demo's prompts and exact-sum reward (with --model "
                        "examples/arithmetic/base_model --device cpu: the small end)")
    p.add_argument("--trl-dtype", choices=("bfloat16", "float32"), default=None,
                   help="the dtype TRL loads the policy in (default: TRL's own, float32: weights, gradients and "
                        "AdamW's moments 16 B/param; bfloat16: 8)")
    p.add_argument("--trl-timeout-s", type=float, default=None, help="the TRL side's bound (default: --side-timeout-s)")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="TRL's per-device batch (default: --micro-batch); the global batch stays --global-batch")
    p.add_argument("--trl-worker", nargs=4, metavar=("MODEL", "PROMPTS", "REWARD", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    a = parse_args()
    a.size = a.size or next(s for f, s in SHAPES if f == a.model_family)
    if (a.model_family, a.size) not in SHAPES:
        raise SystemExit(f"--model-family {a.model_family} --size {a.size}: the bench has "
                         f"{', '.join(f'{f} {s}' for f, s in SHAPES)}")
    if a.miles_flags is None:
        a.miles_flags = MILES_FLAGS if a.size == "0.5b" else MILES_FLAGS_LARGE
    if a.trl_worker:
        trl_worker(*a.trl_worker, steps=a.trl_steps, a=a)
        return
    if a.global_batch != a.prompts * a.samples:
        raise SystemExit(f"--global-batch {a.global_batch} must be --prompts x --samples "
                         f"({a.prompts * a.samples}): one optimizer step per rollout on both sides")
    with tempfile.TemporaryDirectory() as tmp:
        root = a.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        model = a.model or root / "model"
        params = count_params(model) if a.model else build_model(model, a.model_family, a.size)
        prompts, reward, a.prompt_tokens = write_data(root, a.prompts, a.task)
        setup_s = round(time.monotonic() - t0, 1)
        trl = {"skipped": "--skip-trl"} if a.skip_trl else run_trl(a, root, model, prompts, reward, params)
        miles = {"skipped": "--skip-miles"} if a.skip_miles else run_miles(a, root, model, prompts, reward, params)
        print(json.dumps({"ratios": ratios(miles, trl), "miles": miles, "trl": trl,
                          "setup": {"params": params, "model": str(a.model) if a.model else f"{a.model_family} {a.size}",
                                    "peak_tflops_bf16": PEAK_TFLOPS, "prompts": a.prompts,
                                    "samples": a.samples, "new_tokens": a.new_tokens, "prompt_tokens": a.prompt_tokens, "task": a.task,
                                    "micro_batch": a.micro_batch, "global_batch": a.global_batch,
                                    "setup_s": setup_s, "total_s": round(time.monotonic() - t0, 1)}}, indent=2))


if __name__ == "__main__":
    main()
