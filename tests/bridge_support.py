"""What the bridge tests share: reading a stored run back through the dashboard's JSON API."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

from stepwatch.dashboard.server import make_server, serve_in_thread


def api_runs_and_events(db: Path, run_id: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's entry in ``GET /api/runs`` and its ``GET /api/runs/{id}/events``, from a real
    dashboard server on a free loopback port (shut down before returning)."""
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        host, port = server.server_address[:2]

        def get(path: str) -> Any:
            conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
            try:
                conn.request("GET", path)
                answer = conn.getresponse()
                assert answer.status == 200, (path, answer.status)
                return json.loads(answer.read())
            finally:
                conn.close()

        runs = get("/api/runs")
        events = get(f"/api/runs/{run_id}/events")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    entries = runs["runs"] if isinstance(runs, dict) else runs
    (entry,) = [r for r in entries if r["id"] == run_id]
    return entry, events["events"] if isinstance(events, dict) else events
