"""The API docs pages (``/docs``: Swagger UI, ``/redoc``: ReDoc) served offline, from the installed packages.

FastAPI's own pages load their JavaScript and CSS from a CDN (and ReDoc its fonts from Google), so on a cluster
without internet they render blank. The ``fastapi-offline`` package ships Swagger UI's bundle and CSS and ReDoc's
standalone bundle; this module serves those files under :data:`ASSETS` and builds both pages with FastAPI's own
HTML builders pointed at them. Every URL the pages load is on this server.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
ASSETS = "/docs-assets"
ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def install_api_docs(app: FastAPI) -> frozenset[str]:
    """Adds the two docs pages, the OAuth2 redirect page and the assets to ``app`` (made with ``docs_url=None,
    redoc_url=None``); returns every path they answer on, for the request guard's open paths."""
    title = app.title

    def asset(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{ASSETS}/{name}"

    def openapi_url(request: Request) -> str:
        return f"{request.scope.get('root_path', '')}{app.openapi_url}"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url(request), title=f"{title} - Swagger UI",
            swagger_js_url=asset(request, "swagger-ui-bundle.js"), swagger_css_url=asset(request, "swagger-ui.css"),
            swagger_favicon_url=asset(request, "favicon.png"),
            oauth2_redirect_url=f"{request.scope.get('root_path', '')}{OAUTH2_REDIRECT_URL}")

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url(request), title=f"{title} - ReDoc",
                              redoc_js_url=asset(request, "redoc.standalone.js"),
                              redoc_favicon_url=asset(request, "favicon.png"), with_google_fonts=False)

    @app.get(f"{ASSETS}/{{name}}", include_in_schema=False)
    async def docs_asset(name: str) -> FileResponse:
        if name not in ASSET_FILES:  # only the package's files: no path is ever joined from the request
            raise HTTPException(404, f"no API docs asset {name!r}")
        return FileResponse(ASSET_DIR / name)

    return frozenset({DOCS_URL, REDOC_URL, OAUTH2_REDIRECT_URL, *(f"{ASSETS}/{name}" for name in ASSET_FILES)})
