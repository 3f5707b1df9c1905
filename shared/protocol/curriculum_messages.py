"""The JSON bodies of ``POST /v1/curriculum``: a generator's report to the pass-rate table the hub holds for every
generator (ref_server/hub/curriculum.py), and the hub's answer (the settled prompts, when they changed).

One request per sync, not per draw: the generator sends the solved shares of the groups it scored since its last
report and the settled-set version it holds (``since``); the hub answers its version and the settled keys only when
that version is not the generator's."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt

MAX_KEY_CHARS = 512          # a prompt key (generator.datasets' example_id)
MAX_SHARES_PER_REPORT = 65536

PromptKey = Annotated[str, Field(min_length=1, max_length=MAX_KEY_CHARS)]
Share = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class CurriculumReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window: StrictInt = Field(ge=1, le=10_000, description="generator.curriculum.window: appearances that count.")
    min_appearances: StrictInt = Field(ge=1, le=10_000, description="generator.curriculum.min_appearances.")
    shares: list[tuple[PromptKey, Share]] = Field([], max_length=MAX_SHARES_PER_REPORT, description=(
        "[prompt key, solved share] of each group scored since the last report, in order."))
    drawn: StrictInt = Field(0, ge=0, description="Prompts drawn since the last report.")
    skipped: StrictInt = Field(0, ge=0, description="Of them, passed over by the curriculum.")
    since: str | None = Field(None, max_length=100, description="The settled set's version the generator holds "
                              "(null: none yet): the answer lists the settled keys only when the hub's differs.")


class CurriculumAnswer(BaseModel):
    version: str = Field(description="The settled set's version: it changes whenever the set does, and a restarted "
                         "hub never reuses one of an earlier process (it names the process).")
    settled: list[str] | None = Field(description="Every settled key; null when ``version`` equals the report's "
                                      "``since`` (nothing changed).")
    tracked: int = Field(description="Prompts with at least one recorded share.")
