"""--use-opd --opd-type sglang: the teacher servers score each sample's response tokens.

Each trained sample goes to one teacher of `--opd-teacher-urls`: the one its
`metadata[--opd-teacher-key]` names, else the 'default' one; a sample naming no configured teacher
when there is no default fails the rollout (miles': distilling from the wrong teacher silently is
worse). The request is miles' scoring call, SGLang's `/generate` with the whole sequence (prompt +
response) as `input_ids`, no new token and every input token's logprob (`api.score_body`); the
answer's last response-length input logprobs become `Sample.teacher_logprobs`, which the trainer
packs and subtracts from the advantages (`miles.training.terms`). The HTTP client is the SGLang
engine's (`SGLangClient`): one per teacher server, made on first use, closed by `close`. It needs
aiohttp (the `remote` extra), imported when the first teacher is set up: the executor that imports this
module runs on the base install (miles.config.packages).
"""

from __future__ import annotations

import asyncio
import time
from typing import Mapping

from miles.config.schema import OPD_DEFAULT_TEACHER, parse_opd_teachers
from miles.rollout.engines.sglang import api
from miles.types import Sample

GENERATE = "/generate"


class TeacherServers:
    """The teachers of `--opd-teacher-urls` (name -> URL of the server, or of its /generate)."""

    def __init__(self, teachers: Mapping[str, str], *, key: str = "opd_teacher"):
        from miles.rollout.engines.sglang.client import SGLangClient   # aiohttp: only this path needs it

        self._urls = dict(teachers)
        self._key = key
        self._clients = {url: SGLangClient(url.removesuffix(GENERATE)) for url in dict.fromkeys(self._urls.values())}

    @classmethod
    def from_flags(cls, urls: tuple[str, ...], key: str) -> TeacherServers:
        return cls(parse_opd_teachers(urls), key=key)

    def url_for(self, sample: Sample) -> str:
        """The teacher server that scores `sample` (see the module's docstring)."""
        name = sample.metadata.get(self._key) if isinstance(sample.metadata, dict) else None
        if name is not None and str(name) in self._urls:
            return self._urls[str(name)]
        if OPD_DEFAULT_TEACHER in self._urls:
            return self._urls[OPD_DEFAULT_TEACHER]
        raise ValueError(f"sample of prompt {sample.prompt.index}: metadata[{self._key!r}] = {name!r} names no teacher "
                         f"of --opd-teacher-urls ({', '.join(sorted(self._urls))}) and there is no "
                         f"'{OPD_DEFAULT_TEACHER}' one; add it, or NAME={name}=URL")

    async def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set `teacher_logprobs` of every sample that trains (the others keep None: they are not
        trained on); returns the rollout's metrics."""
        todo = [s for s in samples if any(s.mask())]
        t0 = time.monotonic()
        scored = await asyncio.gather(*(self._score_one(s) for s in todo))
        for s, logprobs in zip(todo, scored):
            s.teacher_logprobs = logprobs
        return {"opd_teacher_time_s": time.monotonic() - t0, "opd_teacher_samples": float(len(todo))}

    async def _score_one(self, sample: Sample) -> list[float]:
        url = self.url_for(sample)
        body = await self._clients[url].generate(api.score_body(sample.tokens))
        return api.parse_input_logprobs(body, sample.response_ids, url=url)

    async def close(self) -> None:
        """Close every client's connections. Idempotent."""
        for client in self._clients.values():
            await client.close()
