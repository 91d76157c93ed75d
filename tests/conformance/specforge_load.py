"""Load an export with SpecForge's own data code, in the real server's venv (which has SpecForge, torch and
transformers): ``python specforge_load.py EXPORT TOKENIZER OUT.json``.

``specforge.data.prompt_builder.prepare_prompt_tasks`` is the loader behind SpecForge's ``data.prompts_path``
and ``train_data_path``: a file whose first record has ``input_ids`` and ``loss_mask`` is pre-tokenized,
any other is conversation rows it templates and tokenizes. OUT.json gets, per loaded row, its sample id and
the ``input_ids`` / ``loss_mask`` SpecForge trains on. Conversation rows are shuffled by SpecForge
(``build_eagle3_dataset``, seed 42) and lose their ids; the same shuffle of the file gives them back.
"""

from __future__ import annotations

import json
import sys

#: The tiny model's template is ``role: content\n``; SpecForge needs it registered to find the replies.
#: Its default system prompt must never reach a row that carries its own system turn.
TEMPLATE = "tokenfleet-tiny"
SPECFORGE_DEFAULT_SYSTEM = "SPECFORGE DEFAULT SYSTEM PROMPT"
SHUFFLE_SEED = 42
MAX_LENGTH = 8192


def main(export: str, tokenizer_dir: str, out: str) -> None:
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate
    from transformers import AutoTokenizer

    TEMPLATE_REGISTRY.register(
        TEMPLATE,
        ChatTemplate(
            assistant_header="assistant: ",
            user_header="user: ",
            system_prompt=SPECFORGE_DEFAULT_SYSTEM,
            end_of_turn_token="\n",
        ),
        override=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tasks = prepare_prompt_tasks(
        export,
        tokenizer,
        chat_template=TEMPLATE,
        max_length=MAX_LENGTH,
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
    )
    with open(export, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if "loss_mask" in records[0]:
        ids = [str(r["id"]) for r in records]
    else:
        from datasets import load_dataset

        ids = [
            str(i)
            for i in load_dataset("json", data_files=export, split="train").shuffle(seed=SHUFFLE_SEED)["id"]
        ]
    rows = [
        {"input_ids": list(t["payload"]["input_ids"]), "loss_mask": list(t["payload"]["loss_mask"])}
        for t in tasks
    ]
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"ids": ids, "rows": rows}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
