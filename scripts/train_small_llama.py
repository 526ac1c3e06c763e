#!/usr/bin/env python3
"""Train a small Llama on a CUDA host in a few minutes: a real, trained model for the GPU tests.

A development tool that runs on the GPU host (scripts/gpu_run.sh, stage real-model), never in the
gateway or a worker. The host cannot download a model and takes at most 64 MiB per run, so the
weights are made there: a byte-level BPE tokenizer and a ~34M-parameter Llama (8 layers, hidden
512, 8 heads, 4 K/V heads, vocabulary 8192) are trained on the calibration text that the
exllamav2 and exllamav3 wheels ship (wiki, C4, code, technical, multilingual; about 6 MB once
duplicates are dropped) plus synthetic ChatML chats (capitals, sums, JSON, repeating words), for
a fixed wall-clock budget. Its answers are right on what it was taught ("The capital of France is
Paris."), and its distributions are peaked like a real model's, which is what correctness tests
of an engine need: random weights give near-ties everywhere.

The folder it writes is a Hugging Face Llama folder as transformers saves it (rope_theta 100000,
so transformers 5 nests it under rope_parameters: the trap exllamav2 0.3.2 falls into), FP16
safetensors, tokenizer.json, a ChatML chat template, generation_config.json, and beside the
weights `heldout.txt` (text held out of training, for perplexity and token agreement) and
`train_report.json` (steps, tokens, losses, seconds).

    python3 scripts/train_small_llama.py OUT_DIR [--seconds 150] [--text FILE_OR_DIR ...]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import random
import time
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, opened by <|endoftext|> as every training document is (the model's BOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=2048,
)
ROPE_THETA = 100000.0
HELDOUT_CHARS = 60_000  # from the end of each calibration file

CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Germany": "Berlin",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Russia": "Moscow",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Denmark": "Copenhagen",
    "Hungary": "Budapest",
    "Australia": "Canberra",
    "Argentina": "Buenos Aires",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Iran": "Tehran",
    "Switzerland": "Bern",
    "Czechia": "Prague",
    "Morocco": "Rabat",
    "Nigeria": "Abuja",
    "Cuba": "Havana",
}
NAMES = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemal", "Lea"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def calibration_texts(extra: list[Path]) -> dict[str, str]:
    """Text files by content hash: the wheels' calibration data (identical files counted once)."""
    paths: list[Path] = []
    for package in ("exllamav2", "exllamav3"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            paths += sorted((Path(spec.origin).parent / "conversion" / "standard_cal_data").glob("*.utf8"))
    for item in extra:
        paths += sorted(item.glob("**/*.utf8")) + sorted(item.glob("**/*.txt")) if item.is_dir() else [item]
    texts: dict[str, str] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.setdefault(hashlib.sha256(text.encode()).hexdigest(), text)
    if not texts:
        raise SystemExit("no training text: install exllamav2 or exllamav3, or pass --text")
    return texts


def chat(user: str, assistant: str, rng: random.Random) -> str:
    system = rng.choice([None, None, "You are a helpful assistant.", "Answer briefly."])
    turns = ([("system", system)] if system else []) + [("user", user), ("assistant", assistant)]
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def synthetic_chats(count: int, words: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.35:
            country, capital = rng.choice(list(CAPITALS.items()))
            question = rng.choice(
                [
                    "What is the capital of {}?",
                    "Which city is the capital of {}?",
                    "Name the capital of {}.",
                    "What's the capital city of {}?",
                ]
            ).format(country)
            chats.append(chat(question, f"The capital of {country} is {capital}.", rng))
        elif kind < 0.6:
            a, b = rng.randrange(0, 50), rng.randrange(0, 50)
            chats.append(chat(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", rng))
        elif kind < 0.75:
            name, age = rng.choice(NAMES), rng.randrange(18, 90)
            chats.append(
                chat(
                    f"Person: {name}, {age} years old. Write this person as JSON with keys name and age.",
                    json.dumps({"name": name, "age": age}),
                    rng,
                )
            )
        elif kind < 0.9:
            phrase = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 9)))
            chats.append(chat(f"Repeat after me: {phrase}", phrase, rng))
        else:
            n = rng.randrange(3, 11)
            chats.append(
                chat(f"Count from one to {NUMBER_WORDS[n]}.", ", ".join(NUMBER_WORDS[1 : n + 1]) + ".", rng)
            )
    return chats


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer: Any, documents: list[str]) -> list[int]:
    """Documents encoded and joined, each preceded by <|endoftext|> (the model's BOS)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.append(0)
        ids.extend(encoding.ids)
    return ids


def write_folder(out: Path, model: Any, tokenizer: Any) -> None:
    import torch

    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": SHAPE["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0]}) + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seconds", type=float, default=150.0, help="wall-clock training budget")
    parser.add_argument("--text", type=Path, action="append", default=[], help="more text (file or folder)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--chats", type=int, default=40_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer, 128-wide model (a smoke test of the script)"
    )
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    torch.manual_seed(args.seed)
    texts = list(calibration_texts(args.text).values())
    train_texts = [t[:-HELDOUT_CHARS] for t in texts if len(t) > 4 * HELDOUT_CHARS] + [
        t for t in texts if len(t) <= 4 * HELDOUT_CHARS
    ]
    heldout = "\n".join(t[-HELDOUT_CHARS:] for t in texts if len(t) > 4 * HELDOUT_CHARS)
    words = sorted({w for t in train_texts for w in t.split()[:20000] if w.isalpha() and len(w) < 12})
    chats = synthetic_chats(args.chats, words, args.seed)
    shape = dict(SHAPE)
    if args.tiny:
        shape.update(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    # Paragraph-sized documents: the tokenizer trainer and the batch encoder both want many small ones.
    documents = [p for t in train_texts for p in t.split("\n\n") if p.strip()] + chats
    tokenizer = train_tokenizer(documents, shape["vocab_size"])
    train_ids = torch.tensor(token_stream(tokenizer, documents), dtype=torch.long)
    held_ids = torch.tensor(token_stream(tokenizer, [p for p in heldout.split("\n\n") if p.strip()]))
    print(
        f"data: {len(train_ids):,} training tokens ({len(chats):,} chats), {len(held_ids):,} held out; "
        f"tokenizer {time.monotonic() - started:.1f}s",
        flush=True,
    )

    config = LlamaConfig(
        **shape,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        attention_bias=False,
        mlp_bias=False,
    )
    if getattr(config, "rope_theta", ROPE_THETA) != ROPE_THETA:  # transformers 4 reads the flat key
        config.rope_theta = ROPE_THETA
    device = torch.device(args.device)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)

    def batch(ids: torch.Tensor, size: int) -> torch.Tensor:
        starts = torch.randint(0, len(ids) - args.seq_len - 1, (size,), generator=generator)
        return torch.stack([ids[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        with autocast:
            logits = model(rows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())

    budget, warmup, step, tokens, losses = args.seconds, 100, 0, 0, []
    train_started = time.monotonic()
    model.train()
    while (elapsed := time.monotonic() - train_started) < budget:
        # Linear warm-up, then cosine decay over the time budget (the step count is not known ahead).
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        loss = loss_of(batch(train_ids, args.batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, tokens = step + 1, tokens + args.batch * args.seq_len
        if step % 200 == 0:
            losses.append(float(loss))
            print(
                f"step {step} loss {losses[-1]:.3f} ({elapsed:.0f}s, {tokens / elapsed:,.0f} tok/s)",
                flush=True,
            )

    model.eval()
    with torch.inference_mode():
        held_loss = float(torch.stack([loss_of(batch(held_ids, 8)) for _ in range(8)]).mean())
        train_loss = float(torch.stack([loss_of(batch(train_ids, 8)) for _ in range(8)]).mean())
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    write_folder(out, model, tokenizer)
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    saved = json.loads((out / "config.json").read_text())
    report = {
        "parameters": params,
        "steps": step,
        "tokens": tokens,
        "train_seconds": round(time.monotonic() - train_started, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_ppl": round(math.exp(held_loss), 2),
        "rope_theta_top_level": saved.get("rope_theta"),
        "rope_parameters": saved.get("rope_parameters"),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("trained:", json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
