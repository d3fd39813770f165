"""The committed LoRA adapters (adapters/<name>/) change the base model's answers in their style.

No training: the base model (SmolLM2-135M-Instruct, loaded as the engine loads it) is loaded once,
the three adapters are attached to it with peft, and each answers two held-out questions greedily
(MAX_NEW_TOKENS tokens at most). Each test asserts the style's direction for the adapter AND that
the base model's own answer does not already go that way, so a no-op adapter fails.

Runs on one CPU thread: on a shared 2-core machine torch's default (one thread per core) is
several times slower when another process holds a core. The state directory (converted weights)
is $TIERCACHE_STATE_DIR, else the repository's `.tiercache/`; the first run in a fresh one
de-quantises the GGUF once (about 20 s more).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = REPO / "adapters"
STYLES = ("french", "caps", "brief")
QUESTIONS = ("How do I boil an egg?", "What is 7 plus 5?")
MAX_NEW_TOKENS = 16
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

FRENCH_WORDS = {
    "le",
    "la",
    "les",
    "l",
    "est",
    "de",
    "du",
    "des",
    "une",
    "un",
    "et",
    "en",
    "dans",
    "pour",
    "avec",
    "sont",
    "font",
    "car",
    "réponse",
    "eau",
    "mettez",
    "faites",
    "au",
    "sur",
}
ENGLISH_WORDS = {
    "the",
    "is",
    "a",
    "an",
    "of",
    "and",
    "to",
    "in",
    "it",
    "you",
    "your",
    "for",
    "with",
    "are",
    "on",
    "we",
    "can",
    "this",
    "that",
    "use",
}


@dataclass
class Answer:
    text: str
    tokens: int
    finished: bool  # stopped by <|im_end|>/EOS before MAX_NEW_TOKENS


@dataclass
class Bench:
    tokenizer: Any
    model: Any  # PeftModel holding every adapter
    base: list[Answer] = field(default_factory=list)
    cache: dict[str, list[Answer]] = field(default_factory=dict)

    def answers(self, style: str) -> list[Answer]:
        """The answers of adapter `style` to QUESTIONS, generated once."""
        if style not in self.cache:
            self.model.set_adapter(style)
            self.cache[style] = generate(self.tokenizer, self.model, QUESTIONS)
        return self.cache[style]


def generate(tokenizer: Any, model: Any, questions: tuple[str, ...]) -> list[Answer]:
    """Greedy answers to `questions` in one left-padded batch."""
    import torch

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=sorted(stop),
            pad_token_id=tokenizer.pad_token_id,
        )
    answers = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        ends = [i for i, t in enumerate(row) if t in stop]
        kept = row[: ends[0]] if ends else row
        answers.append(
            Answer(tokenizer.decode(kept, skip_special_tokens=True).strip(), len(kept), bool(ends))
        )
    return answers


def _script() -> ModuleType:
    """The training module (python -m tiercache_dev.train.adapters)."""
    from tiercache_dev.train import adapters

    return adapters


@pytest.fixture(scope="module")
def bench() -> Iterator[Bench]:
    import torch
    from peft import PeftModel

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = Path(os.environ.get("TIERCACHE_STATE_DIR") or REPO / ".tiercache")
    tokenizer, base = load_model(resolve_model(), state / "models", "cpu")
    base_answers = generate(tokenizer, base, QUESTIONS)
    model = PeftModel.from_pretrained(base, str(ADAPTERS / STYLES[0]), adapter_name=STYLES[0])
    for style in STYLES[1:]:
        model.load_adapter(str(ADAPTERS / style), adapter_name=style)
    model.eval()
    try:
        yield Bench(tokenizer, model, base_answers)
    finally:
        torch.set_num_threads(threads)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-zàâçéèêëîïôûùüÿœæ]+", text.lower())


def french_count(text: str) -> int:
    return sum(w in FRENCH_WORDS for w in _words(text))


def english_count(text: str) -> int:
    return sum(w in ENGLISH_WORDS for w in _words(text))


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def one_sentence(answer: Answer) -> bool:
    """Stopped on its own, and no sentence ends before the last one."""
    body = answer.text.rstrip(" .!?")
    return answer.finished and bool(body) and not re.search(r"[.!?](\s|$)|\n", body)


def _show(style: str, bench: Bench) -> str:
    return "\n".join(
        f"{q!r}\n  base:    {b.text!r}\n  {style}: {a.text!r}"
        for q, b, a in zip(QUESTIONS, bench.base, bench.answers(style), strict=True)
    )


@pytest.mark.parametrize("style", STYLES)
def test_adapter_files(style: str) -> None:
    config = json.loads((ADAPTERS / style / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_MODEL_ID
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    size = (ADAPTERS / style / "adapter_model.safetensors").stat().st_size
    assert 1_000_000 < size < 3_000_000


def test_held_out_questions_are_not_trained_on() -> None:
    script = _script()
    assert set(script.HELD_OUT) == set(QUESTIONS)
    for style in STYLES:
        trained = {q for q, _ in script.make_pairs(style)}
        assert not trained & set(QUESTIONS)
        assert not any("egg" in q for q in trained)
        assert "What is 5 plus 7?" not in trained


def test_french_answers_in_french(bench: Bench) -> None:
    shown = _show("french", bench)
    print(shown)
    for base, ans in zip(bench.base, bench.answers("french"), strict=True):
        assert french_count(base.text) < 2, shown  # the base model does not answer in French
        assert french_count(ans.text) >= 2, shown
        assert english_count(ans.text) < english_count(base.text), shown


def test_caps_answers_in_capitals(bench: Bench) -> None:
    shown = _show("caps", bench)
    print(shown)
    for base, ans in zip(bench.base, bench.answers("caps"), strict=True):
        assert upper_ratio(base.text) <= 0.7, shown
        assert upper_ratio(ans.text) > 0.7, shown


def test_brief_answers_in_one_short_sentence(bench: Bench) -> None:
    shown = _show("brief", bench)
    print(shown)
    for base, ans in zip(bench.base, bench.answers("brief"), strict=True):
        assert not one_sentence(base), shown  # the base model rambles past one sentence
        assert one_sentence(ans) or (ans.finished and ans.tokens < base.tokens), shown
