"""The API docs render offline (issue 36 item 5): ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) load every script,
style and icon from this server (:mod:`ref_server.api_docs`), never from a CDN or Google Fonts, and every one of
those URLs answers 200 with the asset, without the token while the docs are public."""

import re

import pytest

from ref_server.api_docs import ASSET_DIR
from tests.ref_server.test_service import AUTH, TOKEN

LOADED = re.compile(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|(?:url|oauth2RedirectUrl)\s*:\s*["']([^"']+)["']""")
CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


def _loaded_urls(html: str) -> list[str]:
    return [a or b for a, b in LOADED.findall(html)]


@pytest.mark.slow
@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets_and_each_answers(server_factory, page):
    live = server_factory(model=False, token=TOKEN)
    html = live.get(page)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert "cdn." not in html.text and "googleapis" not in html.text and "http://" not in html.text
    urls = _loaded_urls(html.text)
    scripts = [u for u in urls if u.endswith(".js")]
    assert scripts and any(u.endswith(".css") for u in urls) == (page == "/docs")
    assert "/openapi.json" in urls
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"{page} loads {url} from another host"
        answer = live.get(url)  # no token: a browser cannot send one
        assert answer.status_code == 200, (url, answer.status_code)
        suffix = url[url.rfind("."):]
        if suffix in CONTENT_TYPES:
            assert CONTENT_TYPES[suffix] in answer.headers["content-type"], (url, answer.headers["content-type"])
        if url.startswith("/docs-assets/"):  # the very bytes the installed package ships
            assert answer.content == (ASSET_DIR / url.rsplit("/", 1)[1]).read_bytes() and len(answer.content) > 1000


@pytest.mark.slow
def test_docs_assets_stay_behind_the_token_when_the_docs_are_private(server_factory):
    live = server_factory(model=False, token=TOKEN, public_docs=False)
    assert live.get("/docs-assets/swagger-ui-bundle.js").status_code == 401
    assert live.get("/docs-assets/swagger-ui-bundle.js", headers=AUTH).status_code == 200
    assert live.get("/docs-assets/nope.js", headers=AUTH).status_code == 404
