"""Helpers for tests/test_trl.py: a tiny offline Qwen3, deterministic "sampling", and short TRL runs.

    torchrun --standalone --nproc_per_node 2 tests/trl_check.py FOLDER OUT.pt GA [GA ...]

trains examples/trl_stapo.py's STAPOTrainer for STEPS steps on FOLDER's model and data, once per given
gradient_accumulation_steps, with the same global batch whatever the number of processes, and saves
rank 0's final parameters as {GA: state_dict} to OUT.pt.
"""
import json, os, sys, zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

VOCAB, G, T, PROMPTS_PER_STEP, STEPS = 512, 4, 16, 4, 2


def build(folder, sharpen=5.0):
    """A word-level tokenizer (w1 ... w510, one token each), a 2-layer Qwen3 whose final norm is scaled by
    `sharpen` (p then spreads over ~1e-4 .. 0.5: many S2T candidates, and a spread of H), and 16 prompts
    of 8 words with an "answer" column (for the example's own reward), all in folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    words = ["<pad>"] + [f"w{i}" for i in range(1, VOCAB - 1)] + ["<eos>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    model.save_pretrained(folder)
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for k in range(16):
            prompt = " ".join(f"w{1 + (7 * k + i) % 500}" for i in range(8))
            f.write(json.dumps({"prompt": prompt, "answer": str(k)}) + "\n")


def completion(prompt_ids, j):
    """Sample j of a prompt: 2 to T random words, a function of the prompt and j only (not of the process,
    the batch or the RNG), so one process and two sample exactly the same completions."""
    g = torch.Generator().manual_seed(zlib.crc32(bytes(str((list(prompt_ids), j)), "ascii")))
    n = int(torch.randint(2, T + 1, (1,), generator=g))
    return torch.randint(1, VOCAB - 1, (n,), generator=g).tolist()


def parity_reward(completion_ids, **_):
    """+1 when the completion's ids sum to an even number, else -1: groups of mixed rewards."""
    return [1.0 if sum(ids) % 2 == 0 else -1.0 for ids in completion_ids]


def deterministic(cls):
    """cls with TRL's sampling replaced by completion(): local row r is sample r % G of its prompt (each
    process's share of a generation batch is whole groups)."""
    class Deterministic(cls):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **_):
            return [completion(p, r % G) for r, p in enumerate(prompt_ids)], None
    return Deterministic


def config(out, world=1, ga=1, **kw):
    """G samples of PROMPTS_PER_STEP prompts per optimizer step, split over `world` processes and `ga`
    micro-batches; fp32 (TRL's default is bf16 autocast where the CPU has it); plain SGD and no gradient
    clipping: Adam's first step (g/|g|) and a clip to norm 1 would both hide a wrong gradient scale."""
    from trl import GRPOConfig
    return GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS_PER_STEP * G // world // ga,
                      gradient_accumulation_steps=ga, num_generations=G, max_completion_length=T,
                      max_steps=STEPS, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                      max_grad_norm=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      logging_steps=1, disable_tqdm=True, seed=0, data_seed=0, **{"epsilon_high": 0.28, **kw})


def dataset(folder):
    from datasets import load_dataset
    return load_dataset("json", data_files=os.path.join(folder, "data.jsonl"))["train"]


def trainer(folder, out, world=1, ga=1, cls=None, trainer_kw=None, **config_kw):
    """cls (default: examples/trl_stapo.py's STAPOTrainer) with deterministic sampling, on folder's data."""
    if cls is None:
        from trl_stapo import STAPOTrainer
        cls = STAPOTrainer
    return deterministic(cls)(folder, reward_funcs=parity_reward, train_dataset=dataset(folder),
                              args=config(out, world, ga, **config_kw), **(trainer_kw or {}))


def train(folder, out, world=1, ga=1, cls=None, trainer_kw=None, **config_kw):
    """STEPS optimizer steps; returns the trainer."""
    run = trainer(folder, out, world, ga, cls, trainer_kw, **config_kw)
    run.train()
    return run


def params(run):
    model = run.accelerator.unwrap_model(run.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(offline, "1")
    folder, out, gas = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
    world = int(os.environ.get("WORLD_SIZE", 1))
    runs = {ga: params(train(folder, os.path.join(os.path.dirname(out), f"ga{ga}"), world, ga)) for ga in gas}
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(runs, out)
