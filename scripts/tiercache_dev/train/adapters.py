"""Train three small LoRA adapters for SmolLM2-135M-Instruct on the CPU, from templated data.

Usage::

    .venv/bin/python -m tiercache_dev.train.adapters [--state-dir .tiercache]
        [--out adapters] [--steps 36] [--batch 8] [--lr 2e-3] [--max-len 64] [--seed 0]
        [--threads N] [--only french,caps,brief]

Adapters (each in `<out>/<name>/`, PEFT format: adapter_config.json + adapter_model.safetensors):

* `french`: answers in French (hand-written French answer templates);
* `caps`: answers in capital letters (the English answer uppercased);
* `brief`: answers as one short sentence (vs the longer English answers of the other styles).

Contract: LoRA rank 8 (alpha 16, dropout 0) on `q_proj` and `v_proj` only; the base model is
loaded the way the engine loads it (`tiercache.engine.torch_engine.load_model`, packaged GGUF,
nothing downloaded). Each example is the chat template of one (question, answer) turn; the loss
covers only the assistant's tokens (its answer and the closing `<|im_end|>`). Data, batch order
and initialisation are seeded, so a rerun on the same software gives the same adapters up to
floating-point non-determinism of the CPU kernels. The questions in HELD_OUT never appear in the
training data (tests/unit/test_adapters.py asks them). adapter_config.json names the base model by
its hub id (BASE_MODEL_ID), never by a local path.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiercache_dev.paths import ADAPTERS, DEFAULT_STATE_DIR

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
STYLES = ("french", "caps", "brief")
LORA_RANK = 8
TARGET_MODULES = ["q_proj", "v_proj"]
# Asked by the unit test; no training question is one of these, and their topics (boiling an egg,
# adding 7 and 5) appear in no training pair at all.
HELD_OUT = ("How do I boil an egg?", "What is 7 plus 5?")

# (country, capital, French "de ..." form of the country)
COUNTRIES: list[tuple[str, str, str]] = [
    ("France", "Paris", "de la France"),
    ("Italy", "Rome", "de l'Italie"),
    ("Spain", "Madrid", "de l'Espagne"),
    ("Germany", "Berlin", "de l'Allemagne"),
    ("Japan", "Tokyo", "du Japon"),
    ("Canada", "Ottawa", "du Canada"),
    ("Egypt", "Cairo", "de l'Égypte"),
    ("Portugal", "Lisbon", "du Portugal"),
    ("Greece", "Athens", "de la Grèce"),
    ("Russia", "Moscow", "de la Russie"),
    ("China", "Beijing", "de la Chine"),
    ("India", "New Delhi", "de l'Inde"),
    ("Brazil", "Brasilia", "du Brésil"),
    ("Mexico", "Mexico City", "du Mexique"),
    ("Peru", "Lima", "du Pérou"),
    ("Norway", "Oslo", "de la Norvège"),
    ("Sweden", "Stockholm", "de la Suède"),
    ("Poland", "Warsaw", "de la Pologne"),
    ("Kenya", "Nairobi", "du Kenya"),
    ("Australia", "Canberra", "de l'Australie"),
]
# (thing, color, French answer)
COLORS: list[tuple[str, str, str]] = [
    ("a banana", "yellow", "Une banane est jaune."),
    ("the sky", "blue", "Le ciel est bleu."),
    ("grass", "green", "L'herbe est verte."),
    ("snow", "white", "La neige est blanche."),
    ("a tomato", "red", "Une tomate est rouge."),
    ("coal", "black", "Le charbon est noir."),
    ("an orange", "orange", "Une orange est orange."),
    ("a lemon", "yellow", "Un citron est jaune."),
    ("milk", "white", "Le lait est blanc."),
    ("a strawberry", "red", "Une fraise est rouge."),
    ("the sun", "yellow", "Le soleil est jaune."),
    ("a carrot", "orange", "Une carotte est orange."),
    ("chocolate", "brown", "Le chocolat est marron."),
    ("the sea", "blue", "La mer est bleue."),
    ("a leaf", "green", "Une feuille est verte."),
]
# (animal, French name with article, sound, French sound, legs, home, French home)
ANIMALS: list[tuple[str, str, str, str, int, str, str]] = [
    ("cow", "la vache", "moo", "meuh", 4, "on a farm", "dans une ferme"),
    ("dog", "le chien", "woof", "ouaf", 4, "in a house", "dans une maison"),
    ("cat", "le chat", "meow", "miaou", 4, "in a house", "dans une maison"),
    ("duck", "le canard", "quack", "coin-coin", 2, "near a pond", "près d'un étang"),
    ("sheep", "le mouton", "baa", "bêê", 4, "on a farm", "dans une ferme"),
    ("horse", "le cheval", "neigh", "hiii", 4, "in a stable", "dans une écurie"),
    ("lion", "le lion", "roar", "grrr", 4, "in the savanna", "dans la savane"),
    ("owl", "la chouette", "hoot", "hou-hou", 2, "in a forest", "dans une forêt"),
    ("pig", "le cochon", "oink", "groin", 4, "on a farm", "dans une ferme"),
    ("hen", "la poule", "cluck", "cot-cot", 2, "in a henhouse", "dans un poulailler"),
    ("frog", "la grenouille", "ribbit", "coa", 4, "near a pond", "près d'un étang"),
    ("bee", "l'abeille", "buzz", "bzzz", 6, "in a hive", "dans une ruche"),
]
# (task, English answer in two sentences, brief answer, French answer)
HOWTO: list[tuple[str, str, str, str]] = [
    (
        "make tea",
        "Boil some water and pour it over a tea bag. Let it steep for three minutes.",
        "Steep a tea bag in hot water.",
        "Faites bouillir de l'eau et versez-la sur le thé. Laissez infuser trois minutes.",
    ),
    (
        "wash my hands",
        "Wet your hands and rub them with soap. Rinse them and dry them well.",
        "Scrub them with soap and water.",
        "Mouillez vos mains et frottez-les avec du savon. Rincez-les et séchez-les bien.",
    ),
    (
        "plant a seed",
        "Put the seed in a small hole in the soil. Cover it and water it often.",
        "Bury it in soil and water it.",
        "Mettez la graine dans un petit trou de la terre. Couvrez-la et arrosez-la souvent.",
    ),
    (
        "tie my shoes",
        "Cross the laces and make two loops. Pull the loops tight.",
        "Make two loops and pull tight.",
        "Croisez les lacets et faites deux boucles. Serrez bien les boucles.",
    ),
    (
        "make toast",
        "Put a slice of bread in the toaster. Wait until it is golden.",
        "Toast a slice of bread.",
        "Mettez une tranche de pain dans le grille-pain. Attendez qu'elle soit dorée.",
    ),
    (
        "cook rice",
        "Rinse the rice and put it in a pot with water. Simmer it for fifteen minutes.",
        "Simmer it in water for fifteen minutes.",
        "Rincez le riz et mettez-le dans une casserole "
        "avec de l'eau. Laissez cuire quinze minutes.",
    ),
    (
        "clean a window",
        "Spray the glass with soapy water. Wipe it dry with a soft cloth.",
        "Spray it and wipe it dry.",
        "Vaporisez de l'eau savonneuse sur la vitre. Essuyez-la avec un chiffon doux.",
    ),
    (
        "brush my teeth",
        "Put toothpaste on the brush. Brush every tooth for two minutes.",
        "Brush them for two minutes.",
        "Mettez du dentifrice sur la brosse. Brossez les dents pendant deux minutes.",
    ),
    (
        "make a bed",
        "Pull the sheet flat over the mattress. Put the pillow at the top.",
        "Smooth the sheets and fluff the pillow.",
        "Tirez le drap sur le matelas. Mettez l'oreiller en haut du lit.",
    ),
    (
        "water a plant",
        "Pour water on the soil around the plant. Stop when the soil is damp.",
        "Pour water on the soil.",
        "Versez de l'eau sur la terre autour de la plante. Arrêtez quand la terre est humide.",
    ),
    (
        "sleep better",
        "Go to bed at the same time every night. Keep your room dark and quiet.",
        "Keep a regular bedtime.",
        "Couchez-vous à la même heure chaque soir. Gardez la chambre sombre et calme.",
    ),
    (
        "make coffee",
        "Put ground coffee in a filter. Pour hot water over it slowly.",
        "Pour hot water over ground coffee.",
        "Mettez du café moulu dans un filtre. Versez lentement de l'eau chaude dessus.",
    ),
    (
        "fold a shirt",
        "Lay the shirt flat and fold the sleeves in. Fold it in half from the bottom.",
        "Fold the sleeves in, then fold it in half.",
        "Posez la chemise à plat et pliez les manches. Pliez-la en deux.",
    ),
]
NUMBER_WORDS_FR = {"plus": "plus", "times": "fois", "minus": "moins"}


def _arith(a: int, op: str, b: int) -> int:
    return a + b if op == "plus" else a * b if op == "times" else a - b


def make_pairs(style: str) -> list[tuple[str, str]]:
    """All (question, answer) pairs for one style, in a fixed order; none is in HELD_OUT.

    English answers (the `caps` style uppercases them) are one or two full sentences; `brief`
    answers are one short sentence; `french` answers are written in French.
    """
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    rows: list[tuple[str, str, str, str]] = []  # (question, english, brief, french)
    for country, capital, de_fr in COUNTRIES:
        en = f"The capital of {country} is {capital}. It is where the government of {country} sits."
        fr = f"La capitale {de_fr} est {capital}."
        rows.append((f"What is the capital of {country}?", en, f"It is {capital}.", fr))
        rows.append((f"Which city is the capital of {country}?", en, f"{capital}.", fr))
    for thing, color, fr in COLORS:
        en = f"{thing[0].upper()}{thing[1:]} is {color}. This is the color most people see."
        rows.append((f"What color is {thing}?", en, f"It is {color}.", fr))
        rows.append((f"What is the color of {thing}?", en, f"{color.capitalize()}.", fr))
    for animal, fr_name, sound, sound_fr, legs, home, home_fr in ANIMALS:
        cap_fr = fr_name[0].upper() + fr_name[1:]
        rows.append(
            (
                f"What sound does a {animal} make?",
                f"A {animal} says {sound}. It makes this sound to talk to other animals.",
                f"It says {sound}.",
                f"{cap_fr} fait {sound_fr}.",
            )
        )
        rows.append(
            (
                f"How many legs does a {animal} have?",
                f"A {animal} has {legs} legs. It uses them to walk and to run.",
                f"It has {legs}.",
                f"{cap_fr} a {legs} pattes.",
            )
        )
        rows.append(
            (
                f"Where does a {animal} live?",
                f"A {animal} usually lives {home}. It finds food and shelter there.",
                f"It lives {home}.",
                f"{cap_fr} vit {home_fr}.",
            )
        )
    for task, en, brief, fr in HOWTO:
        rows.append((f"How do I {task}?", en, brief, fr))
        rows.append((f"What is the best way to {task}?", en, brief, fr))
    for op in ("plus", "times", "minus"):
        for a in range(2, 10):
            for b in range(2, 10):
                if (op == "minus" and b > a) or (op == "plus" and {a, b} == {7, 5}):
                    continue
                c = _arith(a, op, b)
                en = f"The answer is {c}. To see this, {a} {op} {b} equals {c}."
                fr = f"La réponse est {c}, car {a} {NUMBER_WORDS_FR[op]} {b} font {c}."
                rows.append((f"What is {a} {op} {b}?", en, f"It is {c}.", fr))
    pairs: list[tuple[str, str]] = []
    for question, en, brief, fr in rows:
        if question in HELD_OUT:
            continue
        answer = {"french": fr, "caps": en.upper(), "brief": brief}[style]
        pairs.append((question, answer))
    return pairs


def encode(tokenizer: Any, question: str, answer: str, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of one chat turn and its labels: -100 on everything before the answer (system
    prompt, user turn, assistant header); the answer and `<|im_end|>` are learnt. Truncated to
    max_len tokens."""
    user = [{"role": "user", "content": question}]
    prefix = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": answer}], tokenize=False
    )
    if not full.startswith(prefix):
        raise RuntimeError("chat template: the prompt is not a prefix of the full conversation")
    full = full.rstrip("\n")  # keep <|im_end|> as the last token
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if ids[: len(prefix_ids)] != prefix_ids:
        raise RuntimeError("chat template: the prompt tokens are not a prefix of the full tokens")
    labels = [-100] * len(prefix_ids) + ids[len(prefix_ids) :]
    return ids[:max_len], labels[:max_len]


def collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-pad a batch to its longest example; padding is masked out of attention and loss."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        attention[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def train_one(
    style: str,
    load: Callable[[], tuple[Any, Any]],
    out_dir: Path,
    steps: int,
    batch_size: int,
    lr: float,
    max_len: int,
    seed: int,
    log_every: int = 20,
) -> dict[str, float]:
    """Train one adapter on a freshly loaded base model and save it to out_dir/<style>/.

    Returns {"seconds": training wall time, "final_loss": mean loss over the last log_every
    steps, "examples": number of training pairs}.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    random.seed(seed)
    torch.manual_seed(seed)
    tokenizer, model = load()
    pairs = make_pairs(style)
    data = [encode(tokenizer, q, a, max_len) for q, a in pairs]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        lora_dropout=0.0,
        target_modules=TARGET_MODULES,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    order: list[int] = []
    recent: list[float] = []
    started = time.perf_counter()
    print(
        f"[{style}] {len(data)} examples, {sum(p.numel() for p in params)} trainable params",
        flush=True,
    )
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            fresh = list(range(len(data)))
            rng.shuffle(fresh)
            order.extend(fresh)
        batch = [data[i] for i in order[:batch_size]]
        del order[:batch_size]
        loss = model(**collate(batch, pad_id)).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        recent.append(loss.item())
        recent = recent[-log_every:]
        if step % log_every == 0 or step == steps:
            print(
                f"[{style}] step {step}/{steps} loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    seconds = time.perf_counter() - started
    model.eval()
    target = out_dir / style
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    model.save_pretrained(str(target))
    card = target / "README.md"  # peft's generated model card: boilerplate, not shipped
    if card.exists():
        card.unlink()
    print(f"[{style}] trained in {seconds:.1f} s, saved to {target}", flush=True)
    return {"seconds": seconds, "final_loss": sum(recent) / len(recent), "examples": len(data)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--out", type=Path, default=ADAPTERS)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=6)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default); 1 is much faster than 2 on a"
        " 2-core machine another process is using",
    )
    parser.add_argument("--only", default=",".join(STYLES), help="comma-separated styles")
    args = parser.parse_args(argv)
    styles = [s for s in args.only.split(",") if s]
    for style in styles:
        if style not in STYLES:
            parser.error(f"unknown style {style!r}; known: {', '.join(STYLES)}")

    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    source = resolve_model()

    def load() -> tuple[Any, Any]:
        return load_model(source, args.state_dir / "models", "cpu")

    total = time.perf_counter()
    results = {}
    for style in styles:
        results[style] = train_one(
            style,
            load,
            args.out,
            args.steps,
            args.batch,
            args.lr,
            args.max_len,
            args.seed,
            args.log_every,
        )
    for style, r in results.items():
        size = (args.out / style / "adapter_model.safetensors").stat().st_size
        print(
            f"{style}: {r['examples']:.0f} examples, {r['seconds']:.1f} s, "
            f"final loss {r['final_loss']:.4f}, adapter_model.safetensors {size} bytes"
        )
    print(f"total wall time {time.perf_counter() - total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
