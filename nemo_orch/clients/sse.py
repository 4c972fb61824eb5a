"""Server-sent events (``text/event-stream``), as the WHATWG HTML standard defines them and
OpenAI-compatible servers stream their replies: each event's data lines joined by newlines,
dispatched at a blank line; comments, ``event``, ``id`` and ``retry`` fields carry no data;
``data: [DONE]`` (OpenAI's end marker) ends the stream. :func:`event_data` never raises,
whatever the text.
"""

from __future__ import annotations

import re

DONE = "[DONE]"
# The standard's line ends only: str.splitlines would also split at U+2028 and the like, which
# JSON written with ensure_ascii=False carries raw.
_LINE_END = re.compile(r"\r\n|\r|\n")


class EventStream(list):
    """The data of a reply's events, in order (what a client got where it expected one JSON
    body): its reader decodes and gathers them."""


def event_data(text: str) -> EventStream:
    """The data of every event in ``text`` (a whole ``text/event-stream`` body), up to
    ``[DONE]``; an event still open when the text ends counts too (a server that closed the
    stream without its last blank line)."""
    events, data = EventStream(), None
    for line in _LINE_END.split(text):
        if not line:
            if data is not None:
                if data == DONE:
                    return events
                events.append(data)
            data = None
            continue
        if line.startswith(":"):
            continue  # a comment (keep-alives)
        name, colon, value = line.partition(":")
        if name != "data":
            continue  # event, id, retry, or a field the standard says to ignore
        value = value[1:] if colon and value.startswith(" ") else value
        data = value if data is None else f"{data}\n{value}"
    if data is not None and data != DONE:
        events.append(data)
    return events
