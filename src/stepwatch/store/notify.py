"""Webhook notifications: a run's alerts and its end, posted as JSON while you are away.

``RunRecorder(notify="https://hooks.slack.com/services/...")`` hands every alert (what was
seen, and what its action did) and the run's end (its status) to a :class:`Notifier`, which
posts each as one JSON object on a thread of its own::

    {"text": "stepwatch run 'baseline' (3): step 20: nonfinite - loss is nan ... [stopping
              training]",
     "content": "...the same...",
     "event": "alert", "run": "baseline", "run_id": 3, "host": "gpu-07",
     "step": 20, "epoch": 2, "kind": "nonfinite", "message": "loss is nan ...",
     "actions": ["stopping training"]}

``text`` is what a Slack incoming webhook shows and ``content`` what a Discord one shows; the
other fields are for anything else that reads JSON. A failing endpoint is tried again a few
times with a growing pause, then the message is counted as lost and one warning is logged for
the run: training never waits on the network. The URL holds secrets (a webhook's token is its
path): it is never stored with the run or logged - messages name only its scheme and host.
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Notifier", "check_notify_url"]

logger = logging.getLogger("stepwatch")

# Pauses before the second, third and fourth try of one message.
_RETRY_PAUSES = (0.5, 2.0, 5.0)
_TIMEOUT = 10.0  # seconds for one HTTP request
_MAX_WAITING = 1000  # messages queued before new ones are dropped (and counted)


def check_notify_url(url: Any) -> str | None:
    """``url`` when it is an ``http(s)://`` URL with a host (or None); a clear error else."""
    if url is None:
        return None
    if not isinstance(url, str):
        raise TypeError(
            f"'notify' must be a webhook URL (a str like 'https://hooks.slack.com/services/...') "
            f"or None, but got {type(url).__name__}."
        )
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(
            f"'notify' must be a URL without spaces or control characters, but the one "
            f"starting {_shown(url)!r} has some; quote them (%20) or copy the URL again."
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"'notify' must be an http:// or https:// URL with a host, but got one starting "
            f"{_shown(url)!r}; pass the webhook URL your chat service gave you."
        )
    return url


def _shown(url: str) -> str:
    """The part of ``url`` that may be shown: its scheme and host (the rest may be a token)."""
    parts = urlsplit(url)
    if parts.hostname:
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}/..."
    return url.split(":", 1)[0] + ":..." if ":" in url else "..."


class Notifier:
    """Posts a run's notifications to one webhook, off the training thread.

    Args:
        url: the webhook (``http(s)://``); see :func:`check_notify_url`.
        run_name: the run's name, in every message.

    Attributes:
        sent: messages the endpoint accepted (a 2xx answer).
        failed: messages given up on after every try (or dropped from a full queue).
    """

    def __init__(self, url: str, run_name: str = "") -> None:
        self.url = check_notify_url(url) or ""
        self.shown = _shown(self.url)
        self.run_name = run_name
        self.run_id: int | None = None
        self.sent = 0
        self.failed = 0
        self._warned = False
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="stepwatch-notify", daemon=True)
        self._thread.start()

    # -- what the run hands over ----------------------------------------------------------------
    def alert(self, message: str, step: int | None, epoch: int | None, data: Any) -> None:
        """An alert event as the store has it (``data``: ``kind``, ``value``, ``actions``)."""
        data = data if isinstance(data, dict) else {}
        actions = [str(a) for a in data.get("actions") or [] if a]
        kind = str(data.get("kind", "alert"))
        done = f" [{'; '.join(actions)}]" if actions else ""
        where = f"step {step}: " if step is not None else ""
        self._send(
            f"{where}{kind} - {message}{done}",
            event="alert",
            step=step,
            epoch=epoch,
            kind=kind,
            message=message,
            actions=actions,
        )

    def end(self, status: str, step: int | None = None) -> None:
        """The run ended with ``status`` (``finished``, ``anomaly``, ``failed``, ...)."""
        self._send(f"ended: {status}", event="end", status=status, step=step)

    def _send(self, summary: str, **fields: Any) -> None:
        if self._closing:
            return
        if len(self._queue) >= _MAX_WAITING:
            self.failed += 1
            return
        title = f"stepwatch run {self.run_name!r}" if self.run_name else "stepwatch run"
        if self.run_id is not None:
            title += f" ({self.run_id})"
        text = f"{title}: {summary}"
        payload = {
            "text": text,
            "content": text[:2000],  # Discord's limit
            "run": self.run_name,
            "run_id": self.run_id,
            "host": socket.gethostname(),
            **fields,
        }
        self._queue.append(payload)
        self._wake.set()

    # -- the posting thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            while self._queue:
                payload = self._queue.popleft()
                try:
                    self._deliver(payload)
                except Exception as exc:  # nothing may end this thread: count, say it once
                    self._failed_once(type(exc).__name__)
            if self._closing and not self._queue:
                return

    def _deliver(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, default=str).encode()
        why = ""
        for attempt in range(len(_RETRY_PAUSES) + 1):
            if attempt:
                time.sleep(_RETRY_PAUSES[attempt - 1])
            request = urllib.request.Request(
                self.url,
                data=body,
                headers={"Content-Type": "application/json", "User-Agent": "stepwatch"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=_TIMEOUT) as answer:
                    if 200 <= answer.status < 300:
                        self.sent += 1
                        return
                    why = f"HTTP {answer.status}"
            except urllib.error.HTTPError as exc:
                why = f"HTTP {exc.code}"
                if 400 <= exc.code < 500 and exc.code not in (408, 429):
                    break  # the endpoint refuses this message: another try will not help
            except urllib.error.URLError as exc:  # refused, unreachable, timed out
                why = str(exc.reason)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                why = type(exc).__name__  # a malformed answer; its text may quote the URL
        self._failed_once(why)

    def _failed_once(self, why: str) -> None:
        """Count a lost message; the first one is logged (naming the endpoint's host only)."""
        self.failed += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "stepwatch notify: could not post to %s (%s); training goes on, and later "
                "messages that fail are counted, not logged",
                self.shown,
                why,
            )

    def finish(self, status: str, run_id: int | None, step: int | None = None) -> None:
        """The run ended: post its end (:meth:`end`) and :meth:`close`."""
        if run_id is not None:
            self.run_id = run_id
        self.end(status, step)
        self.close()

    def close(self, timeout: float = 2.0) -> None:
        """Let the thread post what is queued and stop; wait at most ``timeout`` seconds for
        it (the run's status is already stored). A slow endpoint is not waited for longer:
        the thread goes on posting while the process lives (a daemon: it ends with it)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # still trying: a process that exits now loses them
            logger.warning(
                "stepwatch notify: %d message(s) to %s not posted within %.0f s of the run's "
                "end (the endpoint is slow or away); they are lost if the process exits first",
                len(self._queue) + 1,
                self.shown,
                timeout,
            )
