"""TRL's GRPOTrainer on the examples' next-digit task, for a tokens/s comparison with asyncrl.

    .venv/bin/python benchmarks/trl_grpo.py --steps 6        one JSON line on stdout

Matched with examples/grpo_tiny.py / grpo_async.py: the same tiny Llama (`build_model` of
`next_digit.model`, same seed), the same 14-token character vocabulary (a `tokenizers`
WordLevel tokenizer built here, BOS prepended, so a prompt is the same 3 tokens), the same
data (`next_digit.records`) and reward (`next_digit.score`), 16 prompts x 8 samples = 128 a
step in one micro batch and one optimizer step, sampling at temperature 1.0 (no top-k/top-p),
stop at EOS, `max_new_tokens`; AdamW at a constant lr, no weight decay, grad clip 1.0; the
GRPO loss with group-std-normalized advantages, clip 0.2, token-mean aggregation (TRL's
loss_type="dapo"), and a k3 KL term with beta = kl_coef = 1e-3 against a frozen reference.

What differs: TRL runs everything in ONE process, in order: `model.generate` (HF generate,
KV cache, no continuous batching), the reward, the reference forward, then the training
forward/backward. There is no separate rollout or reference group, no overlap between
generation and training, and no weight sync. With beta > 0 TRL builds the reference model
by `from_pretrained(model.config._name_or_path)`, so the policy is saved to a temporary
directory first (a model built from a config has no path). The reference is a second copy
in the same process: its no-grad forward runs after generation, inside the step. With
num_iterations=1 TRL skips the old-log-prob forward (the ratio is 1 by construction).
Tokens counted are those asyncrl's perf/tokens counts: prompt tokens + completion tokens up
to and including EOS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import next_digit  # noqa: E402
import torch  # noqa: E402
from machine import describe, version  # noqa: E402

from asyncrl.hybrid.models import ModelConfig, build_model  # noqa: E402

# torch threads: each asyncrl group (trainer, rollout) runs one thread on the 2-core box the
# comparison runs on, so TRL gets one too by default (`--threads 2` gives it both cores).
THREADS = 1


def hf_tokenizer(vocab: next_digit.Vocab) -> Any:
    """`vocab` as a PreTrainedTokenizerFast: one token per character, BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {"<pad>": vocab.pad, "<s>": vocab.bos, "</s>": vocab.eos}
    ids.update({c: 3 + i for i, c in enumerate(vocab.chars)})
    tok = Tokenizer(models.WordLevel(ids, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", vocab.bos)])
    tok.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")


def run_trl(steps: int, prompts: int = 16, group_size: int = 8, max_new_tokens: int = 8,
            lr: float = 0.0, seed: int = 0, warmup: int = 2, threads: int = THREADS,
            beta: float = 1e-3) -> dict:
    """Train `steps` GRPO steps with TRL; tokens/s over the steps after the first `warmup`.
    beta: the KL coefficient (0: no reference model)."""
    if steps <= warmup:
        raise ValueError(f"run_trl: steps ({steps}) must be more than warmup ({warmup})")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    vocab = next_digit.Vocab()
    tok = hf_tokenizer(vocab)
    model = build_model(ModelConfig(**next_digit.model(vocab, None, seed)))
    data = Dataset.from_list([{"prompt": vocab.decode(r["prompt"]), "answer": r["answer"]}
                              for r in next_digit.records(vocab, copies=prompts)])
    count = {"samples": 0, "tokens": 0, "completion": 0}

    # Token counts come from the reward function: it sees every generated sample once per
    # step, with TRL's own completion ids (cut after the first EOS, EOS included) and the
    # prompt tokenized as TRL does (`tok(text=prompts)`). That is exactly what TRL adds to
    # state.num_input_tokens_seen.
    def reward(prompts, completions, completion_ids, answer, **kw):
        lens = [len(ids) for ids in completion_ids]
        prompt_lens = [len(ids) for ids in tok(text=prompts)["input_ids"]]
        count["samples"] += len(lens)
        count["completion"] += sum(lens)
        count["tokens"] += sum(lens) + sum(prompt_lens)
        return [next_digit.score(c, a) for c, a in zip(completions, answer, strict=True)]

    marks: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup:
                marks["start"] = (time.perf_counter(), dict(count))
            marks["end"] = (time.perf_counter(), dict(count))

    batch = prompts * group_size
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(os.path.join(tmp, "model"))  # where TRL loads the reference from
        model.config._name_or_path = os.path.join(tmp, "model")
        cfg = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), max_steps=steps, seed=seed,
            per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            num_generations=group_size, max_completion_length=max_new_tokens,
            temperature=1.0, beta=beta, learning_rate=lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo",
            use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False,
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            log_level="error", dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                              processing_class=tok, callbacks=[Clock()])
        trainer.train()
        assert trainer.state.num_input_tokens_seen == count["tokens"], "token counts disagree"

    (t0, c0), (t1, c1) = marks["start"], marks["end"]
    timed, wall = steps - warmup, t1 - t0
    samples = c1["samples"] - c0["samples"]
    return {"bench": "grpo_vs_trl", "system": "trl",
            "tokens_per_s": (c1["tokens"] - c0["tokens"]) / wall, "steps": timed,
            "step_s": wall / timed, "samples_per_step": samples / timed,
            "mean_completion_len": (c1["completion"] - c0["completion"]) / samples,
            "threads": threads, "max_new_tokens": max_new_tokens, "beta": beta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--beta", type=float, default=1e-3)
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only the JSON line
        result = run_trl(args.steps, max_new_tokens=args.max_new_tokens, lr=args.lr,
                         warmup=args.warmup, threads=args.threads, beta=args.beta)
    versions = {d: version(d) for d in ("torch", "trl", "transformers", "accelerate")}
    print(json.dumps({**result, **describe(**versions)}))


if __name__ == "__main__":
    main()
