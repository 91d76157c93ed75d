"""Chat templates: the target model's own tokenizer and template turn conversations into prompt ids.

Shared by the producer (prompts at submit) and the workers (the next prompt of a conversation regenerated
turn by turn), so it sits below both and imports neither.
"""

from chat.templates import *  # noqa: F403
from chat.templates import __all__ as __all__
