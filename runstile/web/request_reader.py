"""How much of an HTTP/1.1 request has arrived: the pure half of the buffering front.

The web processes' event loop (web/gthread.py) reads every request into memory before a
request thread sees it, so a client that sends slowly holds a socket, never a thread
(docs/guarantees.md, "What a hostile client cannot do").  This module decides, from the
bytes received so far, whether the request is complete, still arriving, larger than the
body limit, or malformed.  It does no I/O and keeps its place between calls, so a body
trickling in a few bytes at a time costs linear work, not quadratic.

It is deliberately not a full HTTP parser: gunicorn's parser stays the authority on
syntax.  A head this module cannot frame (several or non-numeric ``Content-Length``s,
``Transfer-Encoding`` beside ``Content-Length``, a coding other than chunked) is handed
on as it is, because gunicorn refuses such a head before it reads any body.  What it
must know itself is where the request ends, and that needs only the framing headers.
"""

from __future__ import annotations

import re
from enum import Enum

from ..errors import MalformedRequest, RequestHeadersTooLarge, RequestLineTooLong, RunstileError

#: The blank line that ends a head: LF, an optional CR, LF (bare LFs are gunicorn's to refuse).
_HEAD_END = re.compile(rb"\n\r?\n")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")
#: A chunk-size line longer than this is an attack, not a size (16 hex digits + extensions).
MAX_CHUNK_LINE_BYTES = 1024


class Verdict(Enum):
    MORE = "more"              #: keep reading
    COMPLETE = "complete"      #: the whole request is buffered: hand it to a request thread
    OVERSIZED = "oversized"    #: the head is here and the body is over the limit


#: What a request is answered with by the front itself, before any application code.
Refusal = RunstileError

class RequestReader:
    """Feed it received bytes; it says when the request they begin is whole.

    ``max_line_bytes`` bounds the request line, ``max_head_bytes`` the whole head and
    ``max_body_bytes`` the (decoded) body.  A request over the body limit is not read
    further: the application answers it (a 401 comes before a 413) and the connection
    is then drained and closed (docs/api.md, "Bodies over the limit").
    """

    def __init__(self, *, max_body_bytes: int, max_line_bytes: int, max_head_bytes: int,
                 data: bytes = b"") -> None:
        self.max_body_bytes = max_body_bytes
        self.max_line_bytes = max_line_bytes
        self.max_head_bytes = max_head_bytes
        self.buffer = bytearray(data)
        #: The client sent ``Expect: 100-continue`` and waits for a go-ahead to send its body.
        self.expects_continue = False
        self._head_end: int | None = None
        self._length: int | None = None      # body bytes expected, for Content-Length
        self._chunked = False
        self._chunk_at = 0                   # where the next chunk-size line starts
        self._decoded = 0                    # chunk data bytes announced so far

    def feed(self, data: bytes = b"") -> Verdict | Refusal:
        self.buffer += data
        if self._head_end is None:
            verdict = self._read_head()
            if verdict is not None:
                return verdict
        if self._chunked:
            return self._read_chunks()
        assert self._head_end is not None
        if self._length is None:
            return Verdict.COMPLETE
        if self._length > self.max_body_bytes:
            return Verdict.OVERSIZED
        return Verdict.COMPLETE if len(self.buffer) >= self._head_end + self._length \
            else Verdict.MORE

    @property
    def body_started(self) -> bool:
        return self._head_end is not None and len(self.buffer) > self._head_end

    def _read_head(self) -> Verdict | Refusal | None:
        """None once the head is whole and the framing known; a verdict before that."""
        lead = len(self.buffer) - len(self.buffer.lstrip(b"\r\n"))  # ignored empty lines
        line_end = self.buffer.find(b"\n", lead)
        line_bytes = (len(self.buffer) if line_end < 0 else line_end) - lead
        if line_bytes > self.max_line_bytes + 1:
            return RequestLineTooLong(
                f"the request line is longer than {self.max_line_bytes} bytes")
        match = _HEAD_END.search(self.buffer, lead)
        if match is None or match.end() > self.max_head_bytes:
            if len(self.buffer) > self.max_head_bytes:
                return RequestHeadersTooLarge(
                    f"the request head is larger than {self.max_head_bytes} bytes")
            return Verdict.MORE
        self._head_end = match.end()
        return self._frame(bytes(self.buffer[lead:match.start()]))

    def _frame(self, head: bytes) -> Verdict | None:
        lengths, codings = [], []
        for line in head.split(b"\n")[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
            elif name == b"expect" and value.lower() == b"100-continue":
                self.expects_continue = True
        if codings:
            if lengths or codings != [b"chunked"]:
                # gunicorn refuses this framing from the head alone (CL beside TE is a
                # request-smuggling shape); let it, so there is one authority on syntax.
                return Verdict.COMPLETE
            self._chunked, self._chunk_at = True, self._head_end or 0
            return None
        if len(lengths) == 1 and lengths[0].isdigit() and lengths[0].isascii():
            self._length = int(lengths[0])
        elif lengths:
            return Verdict.COMPLETE  # gunicorn refuses it (several, or not a number)
        return None

    def _read_chunks(self) -> Verdict | Refusal:
        """Walk the chunks from where the last call stopped; never re-read a chunk.

        As strict as gunicorn's chunked reader (CRLF everywhere, hex sizes, no bare CR in
        an extension): what passes here must not fail later inside the application.
        """
        buf = self.buffer
        while True:
            line_end = buf.find(b"\r\n", self._chunk_at,
                                self._chunk_at + MAX_CHUNK_LINE_BYTES + 2)
            if line_end < 0:
                if len(buf) - self._chunk_at > MAX_CHUNK_LINE_BYTES:
                    return _bad_chunk("a chunk-size line is too long")
                return Verdict.MORE
            size_text, _, extension = bytes(buf[self._chunk_at:line_end]).partition(b";")
            size_text = size_text.rstrip(b" \t") if extension else size_text
            if not _HEX.fullmatch(size_text) or b"\r" in extension:
                return _bad_chunk("a chunk-size line is not a hexadecimal size")
            size = int(size_text, 16)
            if size == 0:
                return self._read_trailers(line_end + 2)
            if self._decoded + size > self.max_body_bytes:
                return Verdict.OVERSIZED
            data_end = line_end + 2 + size
            if len(buf) < data_end + 2:
                return Verdict.MORE  # this chunk-size line is read again with more bytes
            if buf[data_end:data_end + 2] != b"\r\n":
                return _bad_chunk("a chunk is not followed by CRLF")
            self._decoded += size
            self._chunk_at = data_end + 2

    def _read_trailers(self, at: int) -> Verdict | Refusal:
        """After the last chunk: trailer lines, then a blank line."""
        if self.buffer[at:at + 2] == b"\r\n" or self.buffer.find(b"\r\n\r\n", at) >= 0:
            return Verdict.COMPLETE
        if len(self.buffer) - at > self.max_head_bytes:
            return RequestHeadersTooLarge(
                f"the trailer section is larger than {self.max_head_bytes} bytes")
        return Verdict.MORE


def _bad_chunk(why: str) -> Refusal:
    return MalformedRequest(f"malformed chunked body: {why}")
