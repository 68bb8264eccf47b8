"""webui/login.py's page words: one page for every browser, so English leads when the studio's language
is "auto" (a browser that sends no language gets English), Chinese after it."""

from __future__ import annotations

from webui.login import login_message
from webui.texts import Texts


def test_auto_leads_with_english_and_keeps_chinese() -> None:
    """Before: the title and the first line were Chinese."""
    page = login_message("auto")
    assert page.startswith(f"<b>{Texts('en')('title')}</b><br>Sign in")
    assert "密码" in page and page.index("Sign in") < page.index("密码")


def test_a_fixed_language_is_that_language_only() -> None:
    assert "密码" in login_message("zh") and "Sign in" not in login_message("zh")
    assert "Sign in" in login_message("en") and "密码" not in login_message("en")
