"""The admin page (gateway/admin_page.html): one HTML file with its CSS and JavaScript, served at `/`.

It is sent with a Content-Security-Policy that lets its own inline style and script run (by their
SHA-256) and nothing else: no other script, no request but to this listener, no frame around it.
What a client named (topics, queues, peers) only ever reaches the page as text, but the policy
holds even if that ever failed.
"""

from __future__ import annotations

import base64
import hashlib
import re

from polymq.adapters.http import Request, Response

HTML_TYPE = "text/html; charset=utf-8"
_BLOCKS = {kind: re.compile(rf"<{kind}>(.*?)</{kind}>".encode(), re.DOTALL) for kind in ("script", "style")}


def _hashes(html: bytes, kind: str) -> str:
    found = [base64.b64encode(hashlib.sha256(block).digest()).decode() for block in _BLOCKS[kind].findall(html)]
    return " ".join(f"'sha256-{digest}'" for digest in found) or "'none'"


def content_security_policy(html: bytes) -> str:
    return (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class AdminPage:
    def __init__(self, html: bytes) -> None:
        self.html = html
        self.headers = (
            ("Content-Security-Policy", content_security_policy(html)),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"),
            ("Cache-Control", "no-store"),
        )

    def serve(self, request: Request, _: str) -> Response:
        return Response(200, self.html, HTML_TYPE, self.headers)
