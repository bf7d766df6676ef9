"""The chat page: static files shipped in this package, served same-origin under a strict CSP.

The page (`static/index.html`, `app.js`, `style.css`) talks to the server's own OpenAI chat
completions API with streaming, as any other client does: it holds no server state and no
secrets (an API key typed into it stays in the tab's session storage). Markdown is rendered by
the vendored markdown-it with raw HTML off, so a model that writes `<script>` shows text, and
the Content-Security-Policy allows scripts, styles and connections to this origin only (no
inline script, no eval), so nothing a reply contains can run or reach another host.

`GET /chat` always answers the page. `GET /` answers it only to a browser (an `Accept` that
names `text/html`): every other caller of `/` (Ollama's liveness probe, `HEAD /`) still gets
Ollama's plain-text answer from the Ollama routes, which this module does not touch.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

PAGE_PATH = "/chat"
STATIC_PREFIX = "/webui/"

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",  # attached pictures are shown from data: URLs
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".png": "image/png",
}


@lru_cache(maxsize=1)
def static_files() -> dict[str, tuple[bytes, str]]:
    """Every file under static/ by its path there, read once: the only names the route serves."""
    found: dict[str, tuple[bytes, str]] = {}
    pending = [("", files("turbospark.webui") / "static")]
    while pending:
        prefix, folder = pending.pop()
        for entry in folder.iterdir():
            name = prefix + entry.name
            if entry.is_dir():
                pending.append((name + "/", entry))
                continue
            suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
            if suffix in MEDIA_TYPES:
                found[name] = (entry.read_bytes(), MEDIA_TYPES[suffix])
    return found


def _file(name: str, method: str) -> Response:
    found = static_files().get(name)
    if found is None:
        return Response(f"no file {name!r} in the web UI\n", status_code=404, media_type="text/plain")
    body, media_type = found
    return Response(b"" if method == "HEAD" else body, media_type=media_type, headers=SECURITY_HEADERS)


async def page(request: Request) -> Response:
    return _file("index.html", request.method)


async def static(request: Request) -> Response:
    return _file(request.path_params["name"], request.method)


def routes() -> list[Route]:
    return [
        Route(PAGE_PATH, page, methods=["GET", "HEAD"]),
        Route(STATIC_PREFIX + "{name:path}", static, methods=["GET", "HEAD"]),
    ]


def wants_html(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"accept":
            return b"text/html" in value.lower()
    return False


class BrowserHome:
    """ASGI middleware: a browser's `GET /` is served the page (routed as `/chat`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/"
            and scope["method"] == "GET"
            and wants_html(scope)
        ):
            scope = {**scope, "path": PAGE_PATH, "raw_path": PAGE_PATH.encode()}
        await self.app(scope, receive, send)
