"""The studio's login when the server has API keys: Gradio's form, any user name, one of the keys as password.

Gradio keeps only the user name of a login (its session cookie maps to that name), so the name alone cannot
say which key signed in, and two people may pick the same name. ``KeyLogin.tag`` therefore appends the key's
fingerprint to the name on its way into Gradio's ``/login`` ("alice" -> "alice~3fa9c2d17b0e4a61", done by
the ``TaggedLogin`` middleware); ``owner`` maps a session's name back to the key's voice namespace, the one
the API gives the same key, so voices saved in the studio and through the API are one collection.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import secrets
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from webui.texts import UI_LANGS, Texts

TAG = "~"  # between the typed name and the key's fingerprint
MAX_FORM_BYTES = 64 << 10  # a login form is a name and a key; anything longer is refused unread


class KeyLogin:
    """Who may sign in (``check``, Gradio's ``auth``) and whose voices a signed-in session uses (``owner``).
    ``owner_of_key`` is the API's key -> voice namespace (``api.auth.owner_of``)."""

    def __init__(self, keys: Sequence[str], owner_of_key: Callable[[str], str]):
        if not keys:
            raise ValueError("a login needs at least one key")
        self.keys, self.owner_of_key = tuple(keys), owner_of_key
        self._salt = secrets.token_bytes(16)  # fingerprints mean nothing outside this process
        self.session_user: Callable[[Any], str | None] = lambda _request: None  # set by ``bind``

    def fingerprint(self, key: str) -> str:
        return hmac.new(self._salt, key.encode(), hashlib.sha256).hexdigest()[:16]

    def key_of(self, password: str) -> str | None:
        # every key is compared, in constant time each: the time does not tell which one matched
        found = [k for k in self.keys if hmac.compare_digest(password.encode(), k.encode())]
        return found[0] if found else None

    def check(self, username: str, password: str) -> bool:
        """Gradio's auth: a key as the password, and the name tagged with that key (so the middleware ran)."""
        key = self.key_of(password)
        return key is not None and username.rpartition(TAG)[2] == self.fingerprint(key)

    def tag(self, fields: list[tuple[str, str]]) -> bytes:
        """The login form, url-encoded, with the user name tagged by the password's key (as typed when no
        key matches: Gradio's check then refuses it)."""
        values = dict(fields)
        key = self.key_of(values.get("password", ""))
        if key is not None:
            name = f"{values.get('username', '').strip()}{TAG}{self.fingerprint(key)}"
            fields = [(k, name if k == "username" else v) for k, v in fields]
        return urlencode(fields).encode()

    def owner(self, username: str | None) -> str | None:
        """The voice namespace of a signed-in session's user name; None when it names no key."""
        fingerprint = (username or "").rpartition(TAG)[2]
        found = [k for k in self.keys if hmac.compare_digest(self.fingerprint(k), fingerprint)]
        return self.owner_of_key(found[0]) if found else None

    def bind(self, gradio_app: Any) -> None:
        """Read sessions from the mounted Gradio app: its login cookie names a token it maps to the user."""

        def user(request: Any) -> str | None:
            cookie_id = gradio_app.cookie_id
            token = request.cookies.get(f"access-token-{cookie_id}") or request.cookies.get(
                f"access-token-unsecure-{cookie_id}"
            )
            return gradio_app.tokens.get(token) if token else None

        self.session_user = user

    def signed_in(self, request: Any) -> bool:
        return self.owner(self.session_user(request)) is not None


def login_message(ui_lang: str) -> str:
    """The login page's words: the product's name and how to sign in (both languages for ``auto``, English
    first: the page is one for every browser, and one that sends no language gets English)."""
    langs = ("en", *(lang for lang in UI_LANGS if lang != "en")) if ui_lang not in UI_LANGS else (ui_lang,)
    lines = [html.escape(Texts(lang)("login_hint")) for lang in langs]
    return f"<b>{html.escape(Texts(langs[0])('title'))}</b><br>" + "<br>".join(lines)


class TaggedLogin:
    """ASGI middleware: a POST to ``{root}/login`` reaches Gradio with its user name tagged (``tag``)."""

    def __init__(self, app: Any, login: KeyLogin, root: str = ""):
        self.app, self.login, self.path = app, login, root.rstrip("/") + "/login"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = str(scope.get("path", "")).rstrip("/")
        if scope["type"] != "http" or scope["method"] != "POST" or path != self.path:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if int(request.headers.get("content-length") or 0) > MAX_FORM_BYTES:
            await PlainTextResponse("a login form is a name and a key", 413)(scope, receive, send)
            return
        # Gradio's page posts multipart form data, other clients url-encoded: either is read, and it goes on
        # url-encoded (the form Gradio's login route reads either way)
        async with request.form() as form:
            fields = [(k, v) for k, v in form.multi_items() if isinstance(v, str)]
        body = self.login.tag(fields)
        drop = (b"content-length", b"content-type")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
        headers += [(b"content-type", b"application/x-www-form-urlencoded")]
        headers += [(b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return dict(await receive())
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)
