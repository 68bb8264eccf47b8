"""The prompt lab's page: static markup with its labels, its css and its script (``webui/static/lab.*``).

The markup holds every control, labelled in the page's language; ``lab.js`` fills in the choices (voices,
lexicons, presets from ``/lab/config``), makes the takes and draws the results. Nothing on the page comes from
another owner: the config the script reads is the browser's own namespace.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from webui.lab_texts import TABLES

STATIC = Path(__file__).resolve().parent / "static"
LANGUAGES = ("auto", "zh", "en", "ja", "ko", "yue")
_MARK = re.compile(r"\{\{(\w+)(?::(\w+))?\}\}")  # {{name}} or {{e:label_key}}


def language(accept: str) -> str:
    """ "zh" when the browser's first language is Chinese, else "en"."""
    first = accept.split(",")[0].strip().lower()
    return "zh" if first.startswith("zh") else "en"


def page_html(lang: str) -> str:
    t = TABLES.get(lang, TABLES["en"])

    def e(key: str) -> str:
        return html.escape(t[key])

    other = "en" if lang == "zh" else "zh"
    langs = "".join(f'<option value="{x}">{e("lang_" + x)}</option>' for x in LANGUAGES)
    modes = "".join(
        f'<option value="{m}">{e("mode_" + m)}</option>' for m in ("zero_shot", "cross_lingual", "instruct")
    )
    fills = {
        "lang": lang, "other": other, "langs": langs, "modes": modes,
        "labels": json.dumps(t, ensure_ascii=False).replace("</", "<\\/"),
        "css": (STATIC / "lab.css").read_text(encoding="utf-8"),
        "browser_id": (STATIC / "browser_id.js").read_text(encoding="utf-8"),  # as the studio's head
        "js": (STATIC / "lab.js").read_text(encoding="utf-8"),
    }  # fmt: skip
    template = (STATIC / "lab.html").read_text(encoding="utf-8")
    return _MARK.sub(lambda m: e(m.group(2)) if m.group(1) == "e" else fills[m.group(1)], template)


def promote_script() -> str:
    """``<script>`` for the studio's head: fills the form from a take promoted in the lab."""
    return f"<script>\n{(STATIC / 'lab_promote.js').read_text(encoding='utf-8')}\n</script>"
