"""Agent-session endpoints: ``DELETE /hicache/sessions/{session_id}`` ends a session's
retention (its KV is no longer kept in L2 for a next turn) and its open restores.

Per-session routes need the same key as inference (``--api-key`` when set): whoever may
send a session's requests may end it. An unknown session is a 404 (not logged as an
error): it ended already (its TTL passed, or it was closed) or never had a request nor
an open restore.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from hicache.engine.sampling import InvalidRequest
from hicache.engine.session import check_session_id
from hicache.server.http_base import bad_request, error_response
from hicache.server.state import ServerState


def add_session_routes(app: FastAPI, state: ServerState) -> None:
    """Register ``DELETE /hicache/sessions/{session_id}``."""
    engine = state.engine

    @app.delete("/hicache/sessions/{session_id}")
    async def close_session(session_id: str) -> Response:
        """200 ``{"status": "ok", "closed": session_id}``; 404 for a session not live;
        400 for an id no request could have named."""
        try:
            check_session_id(session_id, "session_id")
        except InvalidRequest as exc:
            return bad_request(str(exc), param=exc.param)
        try:
            live = await asyncio.to_thread(engine.close_session, session_id)
        except (RuntimeError, TimeoutError) as exc:  # not running, or stuck
            return error_response(503, f"the session could not be closed: {exc}")
        if not live:
            return error_response(
                404, f"no live session {session_id!r} (ended, or never seen)", "session_id"
            )
        return JSONResponse({"status": "ok", "closed": session_id})
