"""Request -> plan: validate a SynthesisRequest and turn it into what the models compute.

A plan is the LM segments (text ids, prompt-text ids, prompt speech ids per sentence; empty for voice
conversion, whose source speech tokens go straight to the flow) and the flow's prompt conditioning. The
mode decides the layout (spec section 4): zero_shot puts the transcript and prompt speech in the prefix,
cross_lingual neither (v3: the system prompt leads the text), instruct the instruction instead.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from engine.config import Limits
from engine.errors import InvalidInput, TooLarge
from engine.frontend import Frontend, PromptFeatures
from engine.request import Mode, SynthesisRequest
from engine.text import TextFrontend
from engine.voices import Voice, VoiceLibrary


@dataclass(frozen=True)
class Plan:
    segments: list[tuple[list[int], list[int], list[int]]]  # (text ids, prompt-text ids, prompt speech)
    flow_prompt: PromptFeatures
    source_tokens: list[int] | None = None  # vc: the speech to convert


class Planner:
    def __init__(
        self, frontend: Frontend, text: TextFrontend, voices: VoiceLibrary, family: str, limits: Limits
    ):
        self.frontend, self.text, self.voices = frontend, text, voices
        self.family, self.limits = family, limits

    def check(self, req: SynthesisRequest) -> None:
        """Cheap checks before the request takes a slot: InvalidInput / TooLarge with a user-fit message."""
        if req.mode != Mode.VC:
            if not req.text or not req.text.strip():
                raise InvalidInput("the text to speak is empty")
            self._check_text("the text", req.text)
        self._check_text("the prompt transcript", req.prompt_text)
        self._check_text("the instruction", req.instruct_text)
        if req.mode == Mode.INSTRUCT and not req.instruct_text.strip():
            raise InvalidInput("instruct mode needs an instruction (e.g. 'speak happily')")
        if req.mode == Mode.VC and req.source_wav is None and req.source_audio is None:
            raise InvalidInput("voice conversion needs the source speech to convert")
        if req.voice_id is None and req.prompt_wav is None and req.prompt_audio is None:
            raise InvalidInput("a voice is needed: upload or record 3-30 s of speech, or pick a saved voice")
        if req.mode == Mode.ZERO_SHOT and req.voice_id is None and not req.prompt_text.strip():
            raise InvalidInput("zero-shot cloning needs the transcript of the prompt audio")

    def _check_text(self, what: str, text: str) -> None:
        """Length, control characters and lone surrogates (they break the normaliser and tokenizer)."""
        limit = self.limits.max_text_chars
        if len(text) > limit:
            raise TooLarge(f"{what} has {len(text)} characters; the limit is {limit}")
        if any(unicodedata.category(c) == "Cc" and c not in "\n\r\t" for c in text):
            raise InvalidInput(f"{what} contains control characters")
        if any(unicodedata.category(c) == "Cs" for c in text):
            raise InvalidInput(f"{what} is not valid Unicode (it has lone surrogate characters)")

    def plan(self, req: SynthesisRequest) -> Plan:
        """The heavy part (audio decoding, ONNX features, normalisation): run it off the event loop."""
        if req.mode == Mode.VC:
            prompt, _ = self._prompt(req, trim=False)  # the reference does not trim the VC prompt
            source = req.source_audio if req.source_audio is not None else req.source_wav
            assert source is not None  # check() guarantees it
            return Plan([], prompt, list(self.frontend.speech_tokens(source)))
        prompt, transcript = self._prompt(req, trim=True)
        cross = req.mode == Mode.CROSS_LINGUAL
        segments = self.text.prepare(req.text, req.language, req.text_frontend, cross_lingual=cross)
        if not segments:
            raise InvalidInput("the text has nothing to speak after normalisation")
        prompt_ids: list[int] = []
        speech: list[int] = []
        if req.mode == Mode.ZERO_SHOT:
            transcript = self.text.prompt_text(transcript, req.language, req.text_frontend)
            prompt_ids = self.text.tokenize(transcript)
            speech = [int(t) for t in prompt.speech_tokens]
        elif req.mode == Mode.INSTRUCT:
            prompt_ids = self.text.tokenize(self.text.instruct_text(req.instruct_text))
        return Plan([(self.text.tokenize(s), prompt_ids, speech) for s in segments], prompt)

    def _prompt(self, req: SynthesisRequest, trim: bool) -> tuple[PromptFeatures, str]:
        """The voice's features and transcript: a saved voice, or the request's prompt audio."""
        if req.voice_id is not None and req.prompt_wav is None and req.prompt_audio is None:
            example = self.voices.example(req.voice_id, req.voice_owner)
            if example is not None:  # a recording in assets/: its features are cached by the frontend
                return self.frontend.extract(str(example.wav), trim=trim), example.transcript
            voice, features = self.voices.get(req.voice_id, req.voice_owner)
            self._check_family(voice)
            return features, voice.prompt_text
        source = req.prompt_audio if req.prompt_audio is not None else req.prompt_wav
        assert source is not None  # check() guarantees a voice
        return self.frontend.extract(source, trim=trim), req.prompt_text

    def _check_family(self, voice: Voice) -> None:
        if voice.family != self.family:
            raise InvalidInput(
                f"saved voice {voice.name!r} was made for {voice.family}; this server runs {self.family}"
            )
