"""The prompt of the end-of-run sample: a held-out conversation up to its last answer, as inference
renders it.

No text needs rendering again: a conversation's loss mask marks each answer's tokens, and the tokens
before the last answer are the conversation up to it rendered through the template with the
assistant's turn opened (`add_generation_prompt=True`), which data/chat/render.py checked to be a
prefix of the whole conversation, in text and in ids, when it masked it.
"""

from __future__ import annotations

import numpy as np

from data.chat.samples import Conversations


def reply_prompt(conversations: Conversations, index: int) -> list[int] | None:
    """The ids of conversation `index` before its last answer; None where its mask tells no answer
    from the rest (data.train_on "all", every token a target)."""
    start, end = int(conversations.bounds[index]), int(conversations.bounds[index + 1])
    mask = np.asarray(conversations.mask[start:end])
    asked = np.flatnonzero(mask == 0)
    answered = np.flatnonzero(mask)
    if not len(answered) or not len(asked) or asked[0] > answered[-1]:
        return None
    # The last answer starts after the last token before it that is no target.
    opened = int(asked[asked < answered[-1]][-1]) + 1
    return conversations.tokens[start : start + opened].astype(np.int64).tolist()
