"""The one tokenizer the tests build (no hub access): a word-level ``tokenizers`` model saved as a
``PreTrainedTokenizerFast`` folder with a ChatML template. Its special tokens take ids 0-2 (``<unk>``,
``<|im_start|>``, and ``<|im_end|>`` = 2 as EOS), like the simulator's defaults, and every other id
decodes to one word that encodes back to the same id, so the replies the simulator draws survive a
decode / re-template round trip.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
#: Words of the test prompts, then filler words: the simulator draws replies from all of them.
PROMPT_WORDS = (
    "system user assistant you are a helpful terse bot what is two plus three and four tell me more"
)
WORDS = [*PROMPT_WORDS.split(), "why", "say", "hello", "again", *(f"w{i}" for i in range(200))]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_chat_tokenizer(folder: Path, chat_template: str | None = CHATML) -> Path:
    """Save a small real tokenizer with a chat template to ``folder``; returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<unk>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))
    return folder


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(dict.fromkeys(WORDS))


def reference_ids(tokenizer_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as transformers renders it, computed without tokenfleet."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return ids
