"""STAPO in TRL 1.16: a GRPOTrainer whose loss is stapo_loss over the tokens S2T keeps (arXiv 2602.15620).

    accelerate launch --num_processes 8 examples/trl_stapo.py --model Qwen/Qwen3-8B-Base \
        --dataset train.jsonl --output_dir runs/trl_stapo --epsilon_high 0.28 --num_generations 8 \
        --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --max_completion_length 4096
    torchrun --nproc_per_node 2 examples/trl_stapo.py ... --use_cpu        (CPU processes: gloo)

Every GRPOConfig flag works (--help), plus --tau_p, --q, --clip_c (inf: off) and --max_log_ratio. The
dataset is a .json/.jsonl file or a Hub name with "prompt" and "answer" columns; the reward is +1 when the
last \\boxed{...} of the completion is the answer, else -1. Pass --epsilon_high 0.28: TRL's default is
epsilon_high = epsilon = 0.2, the paper's recipe (JustRL's) clips higher.

From this project it takes only stapo_core.py, the paper's pure functions (a user copies that file); TRL
does the rest: sampling, rewards, group advantages, per-token log p and entropy at the sampling
temperature, the completion (and tool) mask, old log-probs, the optimizer loop.

One optimizer step's loss (paper: J_STAPO, the clip-higher token mean over the tokens S2T keeps):
    silenced = S2T's mask of (p, H, A, valid), with one tau_h over the step's candidates on all W processes
    loss = stapo_loss(logp, old_logp, A, valid & ~silenced, num_tokens = kept in the step, all processes / W)
The kept count stays a tensor on the device (stapo_loss divides by it there), and the statistics (clip
fractions, the silenced fraction, tau_h) are kept as tensors and read once per logging step (log).
/ W because accelerate's DDP averages the W processes' gradients. p and H are the policy's at that step,
for all of its micro-batches, before its first backward:
  - gradient_accumulation_steps = 1: the step is one micro-batch, and its own forward gives them;
  - gradient_accumulation_steps = k > 1: one extra no-grad forward over the step's k micro-batches when
    the first arrives (_prepare_inputs); their masks and the step's count ride along in the batches.
So S2T runs once per optimizer step on the current policy, as stapo.py does once per mini-batch, with any
num_iterations and steps_per_generation (TRL then supplies the sampling policy's old log-probs).

With tau_p = 0 (nothing silenced), clip_c=None and max_log_ratio=inf this is TRL 1.16.0's own
GRPOTrainer with loss_type="dapo", every loss and gradient of an optimizer step (tests/test_trl.py), when
steps_per_generation = gradient_accumulation_steps (TRL's default). With a larger multiple, one generation
batch feeds several steps: TRL divides each by the batch's mean tokens per step, this by the step's own count
(DAPO's token mean; S2T needs the step's kept count). clip_c = c is TRL's delta = c whenever c >= 1 + epsilon_high.

It refuses (ValueError), rather than silently drop, what TRL would add to the loss or its mask:
    loss_type != "dapo"                the step's token count is dapo's normaliser (TRL's default)
    beta != 0                          STAPO has no KL term
    importance_sampling_level="sequence", delta (use clip_c), top_entropy_quantile < 1, entropy_coef != 0
    or use_adaptive_entropy, off_policy_mask_threshold, use_vllm with vllm_importance_sampling_correction
    (its default), a MoE router aux loss: each reweights or masks TRL's per-token loss; stapo_loss has none
    steps_per_generation not a multiple of gradient_accumulation_steps: a step would span two generation
                                       batches, and S2T must see all of a step's tokens before its backward
"""
import os, re, sys
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stapo_core import s2t_candidates, s2t_silence, s2t_threshold, stapo_loss  # noqa: E402  the copied file

MM_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
           "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")  # vision


class STAPOTrainer(GRPOTrainer):
    def __init__(self, *args, tau_p=0.002, q=0.75, clip_c=10.0, max_log_ratio=20.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.tau_p, self.q, self.clip_c, self.max_log_ratio = tau_p, q, clip_c, max_log_ratio
        self._stapo_stats = {}  # {mode: {name: [0-dim tensors]}}, read at the next log
        a = self.args
        vllm_is = a.use_vllm and a.vllm_importance_sampling_correction
        refused = {"loss_type != 'dapo'": a.loss_type != "dapo",
                   "beta != 0": a.beta != 0.0,
                   "importance_sampling_level != 'token'": a.importance_sampling_level != "token",
                   "delta (use clip_c)": a.delta is not None,
                   "top_entropy_quantile < 1": a.top_entropy_quantile < 1.0,
                   "an entropy bonus": self._entropy_bonus_enabled,
                   "off_policy_mask_threshold": a.off_policy_mask_threshold is not None,
                   "vllm_importance_sampling_correction": vllm_is,
                   "a MoE router aux loss (router_aux_loss_coef=0)": self.aux_loss_enabled,
                   "steps_per_generation not a multiple of gradient_accumulation_steps":
                       a.steps_per_generation % a.gradient_accumulation_steps != 0}
        if any(refused.values()):
            raise ValueError(f"STAPOTrainer cannot honour: {', '.join(k for k, v in refused.items() if v)}; "
                             "see examples/trl_stapo.py's docstring")

    def _logps_and_entropies(self, model, batch):
        """TRL's per-token log p (with grad) and entropy (detached), at the sampling temperature: [B, T]."""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, ids, attention, batch["completion_ids"].size(1), compute_entropy=True,
            **{k: batch.get(k) for k in MM_KEYS})
        return logp, entropy.detach()

    def _gather_cat(self, x):
        """Every process's 1-D x, concatenated: lengths differ, so pad to the longest, gather, cut."""
        lengths = self.accelerator.gather(torch.tensor([len(x)], device=x.device)).tolist()
        rows = self.accelerator.gather(self.accelerator.pad_across_processes(x))
        return torch.cat([row[:n] for row, n in zip(rows.view(len(lengths), max(lengths)), lengths)])

    def _s2t(self, logps, entropies, batches):
        """The keep masks of one optimizer step's micro-batches (paper: M_{i,t} = 0 where silenced) and
        its loss denominator, a tensor; one tau_h and one kept count over the step on all processes."""
        valids = [(b["completion_mask"] * b.get("tool_mask", 1)).bool() for b in batches]
        candidates = [s2t_candidates(p, b["advantages"], v, tau_p=self.tau_p)
                      for p, b, v in zip(logps, batches, valids)]
        mine = torch.cat([h[c] for h, c in zip(entropies, candidates)])  # this process's candidates' H
        tau_h = s2t_threshold(self._gather_cat(mine), self.q)  # the gather reads each process's count: once
        keeps = [v & ~s2t_silence(c, h, tau_h) for c, h, v in zip(candidates, entropies, valids)]
        counts = torch.stack([sum(k.sum() for k in keeps), sum(v.sum() for v in valids)]).float()
        kept, valid = self.accelerator.reduce(counts, reduction="sum")  # tensors, on the device: never read
        self._stat("silenced_frac", 1 - kept / valid.clamp(min=1))
        if tau_h is not None:
            self._stat("tau_h", tau_h)
        return keeps, kept / self.accelerator.num_processes  # / W: DDP averages the W gradients

    def _stat(self, name, value):
        """A 0-dim tensor kept for the next log, which reads them all at once."""
        mode = "train" if self.model.training else "eval"
        self._stapo_stats.setdefault(mode, {}).setdefault(name, []).append(value.detach().float())

    def log(self, logs, start_time=None):
        """TRL's log, once per logging step, with the mean of each STAPO statistic kept since the last: the
        one read of them from the device (one copy of all of them). TRL's own metrics read theirs as it goes."""
        mode = "train" if self.model.training else "eval"
        stats = self._stapo_stats.pop(mode, {})
        if stats:
            means = torch.stack([torch.stack(v).mean() for v in stats.values()]).tolist()
            for name, mean in zip(stats, means):
                self._metrics[mode][f"stapo/{name}"].append(mean)
        super().log(logs, start_time)

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        ga, spg = self.args.gradient_accumulation_steps, self.args.steps_per_generation
        if self.model.training and ga > 1 and self._step % ga == 0:  # the first micro-batch of a step
            step = [self._buffered_inputs[(self._step + j) % spg] for j in range(ga)]  # inputs is step[0]
            with torch.no_grad():
                pairs = [self._logps_and_entropies(self.model, b) for b in step]
            keeps, num_tokens = self._s2t([p for p, _ in pairs], [h for _, h in pairs], step)
            for b, keep in zip(step, keeps):
                b["stapo_keep"], b["stapo_num_tokens"] = keep, num_tokens
        return inputs

    def _compute_loss(self, model, inputs):
        logp, entropy = self._logps_and_entropies(model, inputs)
        if "stapo_keep" in inputs:  # gradient accumulation: S2T ran over the whole step in _prepare_inputs
            keep, num_tokens = inputs["stapo_keep"], inputs["stapo_num_tokens"]
        else:  # the step is this micro-batch (or an eval batch): its own p and H
            (keep,), num_tokens = self._s2t([logp.detach()], [entropy], [inputs])
        old_logp = inputs.get("old_per_token_logps")  # None when the policy has not moved since sampling
        old_logp = logp.detach() if old_logp is None else old_logp
        loss, stats = stapo_loss(logp, old_logp, inputs["advantages"], keep, num_tokens=num_tokens,
                                 eps_low=self.epsilon_low, eps_high=self.epsilon_high, clip_c=self.clip_c,
                                 max_log_ratio=self.max_log_ratio)
        for name in ("clip_low", "clip_high"):
            self._stat(name, stats[name])  # this process's share of its kept tokens, read at the next log
        return loss


@dataclass
class STAPOArgs:
    model: str = "Qwen/Qwen3-8B-Base"
    dataset: str = "train.jsonl"  # .json/.jsonl or a Hub dataset with "prompt" and "answer" columns
    tau_p: float = 0.002  # S2T: candidates have A > 0 and p < tau_p ...
    q: float = 0.75  # ... and are silenced below the q-quantile of their entropies
    clip_c: float = 10.0  # dual clip for A < 0 (inf: off, the same as clip_c=None)
    max_log_ratio: float = 20.0  # clamp of log(ratio) before exp (inf: off)


def boxed_reward(completions, answer, **_):
    """+1 when the last \\boxed{...} of the completion is the answer, else -1."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    boxed = [re.findall(r"\\boxed\{([^{}]*)\}", t) for t in texts]
    return [1.0 if b and b[-1].strip() == str(a).strip() else -1.0 for b, a in zip(boxed, answer)]


def main():
    from datasets import load_dataset
    from transformers import HfArgumentParser
    script, config = HfArgumentParser((STAPOArgs, GRPOConfig)).parse_args_into_dataclasses()
    local = script.dataset.endswith((".json", ".jsonl"))
    data = load_dataset("json", data_files=script.dataset) if local else load_dataset(script.dataset)
    trainer = STAPOTrainer(script.model, reward_funcs=boxed_reward, args=config, train_dataset=data["train"],
                           tau_p=script.tau_p, q=script.q, clip_c=script.clip_c,
                           max_log_ratio=script.max_log_ratio)
    trainer.train()
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    main()
