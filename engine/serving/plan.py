"""Request -> plan: validate a SynthesisRequest and turn it into what the models compute.

A plan is the LM segments (text ids, prompt-text ids, prompt speech ids per sentence; empty for voice
conversion, whose source speech tokens go straight to the flow) and the flow's prompt conditioning. The
mode decides the layout (spec section 4): zero_shot puts the transcript and prompt speech in the prefix,
cross_lingual neither (v3: the system prompt leads the text), instruct the instruction instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import Limits
from engine.errors import InvalidInput
from engine.frontend import Frontend, PromptFeatures
from engine.request import Mode, SynthesisRequest
from engine.text.checks import check_text
from engine.text.frontend import TextFrontend, format_cross_lingual
from engine.text.pool import TextIds, text_ids, text_job
from engine.voices import Voice, VoiceLibrary

if TYPE_CHECKING:
    from engine.serving.kept_prompts import PromptTensors


@dataclass(frozen=True)
class Plan:
    segments: list[tuple[list[int], list[int], list[int]]]  # (text ids, prompt-text ids, prompt speech)
    flow_prompt: PromptFeatures
    source_tokens: list[int] | None = None  # vc: the speech to convert
    flow_tensors: PromptTensors | None = None  # flow_prompt on the device, where made before the audio


class Planner:
    def __init__(
        self, frontend: Frontend, text: TextFrontend, voices: VoiceLibrary, family: str, limits: Limits
    ):
        self.frontend, self.text, self.voices = frontend, text, voices
        self.family, self.limits = family, limits

    def check(self, req: SynthesisRequest) -> None:
        """Cheap checks before the request takes a slot: InvalidInput / TooLarge with a user-fit message."""
        if req.text_stream is not None and req.mode == Mode.VC:
            raise InvalidInput("voice conversion converts speech, it takes no streamed text")
        if req.mode != Mode.VC and req.text_stream is None:
            if not req.text or not req.text.strip():
                raise InvalidInput("the text to speak is empty", field="text")
            self._check_text("the text", req.text, "text")
        self._check_text("the prompt transcript", req.prompt_text, "prompt_text")
        self._check_text("the instruction", req.instruct_text, "instruct_text")
        if req.mode == Mode.INSTRUCT and not req.instruct_text.strip():
            message = "instruct mode needs an instruction (e.g. 'speak happily')"
            raise InvalidInput(message, field="instruct_text")
        if req.mode == Mode.VC and req.source_wav is None and req.source_audio is None:
            raise InvalidInput("voice conversion needs the source speech to convert", field="source_audio")
        if req.voice_id is None and req.prompt_wav is None and req.prompt_audio is None:
            message = "a voice is needed: upload or record 3-30 s of speech, or pick a saved voice"
            raise InvalidInput(message, field="voice_id")
        if req.mode == Mode.ZERO_SHOT and req.voice_id is None and not req.prompt_text.strip():
            message = "zero-shot cloning needs the transcript of the prompt audio"
            raise InvalidInput(message, field="prompt_text")

    def _check_text(self, what: str, text: str, field: str) -> None:
        """The contract's checks (``engine.text.checks``): the same table every door applies; the text
        to speak also needs something to say and only the supported markup."""
        spoken = field == "text"
        check_text(text, what, field, self.limits.max_text_chars, spoken=spoken, family=self.family)

    def plan(self, req: SynthesisRequest) -> Plan:
        """All of it in this thread (the engine splits it: ``prompt`` in a thread, ``text_ids`` wherever
        its text pool runs it, then ``assemble``)."""
        if req.mode == Mode.VC:
            return self.vc_plan(req)
        prompt, transcript = self.prompt(req)
        if req.text_stream is not None:
            return self.stream_plan(req, prompt, transcript)
        return self.assemble(req, prompt, text_ids(self.text, text_job(req, transcript)))

    def vc_plan(self, req: SynthesisRequest) -> Plan:
        """Voice conversion: prompt features and the source speech's tokens, no text."""
        prompt, _ = self._prompt(req, trim=False)  # the reference does not trim the VC prompt
        source = req.source_audio if req.source_audio is not None else req.source_wav
        assert source is not None  # check() guarantees it
        return Plan([], prompt, list(self.frontend.speech_tokens(source)))

    def prompt(self, req: SynthesisRequest) -> tuple[PromptFeatures, str]:
        """The (trimmed) prompt features and the transcript that goes with them: audio decoding and ONNX
        features, or a saved voice read from disk. Blocking: run it off the event loop."""
        return self._prompt(req, trim=True)

    def assemble(self, req: SynthesisRequest, prompt: PromptFeatures, ids: TextIds) -> Plan:
        speech = [int(t) for t in prompt.speech_tokens] if req.mode == Mode.ZERO_SHOT else []
        return Plan([(seg, ids.prompt, speech) for seg in ids.segments], prompt)

    def stream_plan(self, req: SynthesisRequest, prompt: PromptFeatures, transcript: str) -> Plan:
        """A text-streaming request: only the prompt part now; its text comes later, in pieces."""
        prompt_ids, speech = self._prompt_part(req, prompt, transcript)
        if req.mode == Mode.CROSS_LINGUAL:  # v3: the system prompt leads the input (its text arrives later)
            prompt_ids = self.text.tokenize(format_cross_lingual(self.family, ""))
        return Plan([([], prompt_ids, speech)], prompt)

    def _prompt_part(
        self, req: SynthesisRequest, prompt: PromptFeatures, transcript: str
    ) -> tuple[list[int], list[int]]:
        """The mode's prompt-text ids and prompt speech ids (spec section 4)."""
        prompt_ids: list[int] = []
        speech: list[int] = []
        if req.mode == Mode.ZERO_SHOT:
            transcript = self.text.prompt_text(transcript, req.language, req.text_frontend)
            prompt_ids = self.text.tokenize(transcript)
            speech = [int(t) for t in prompt.speech_tokens]
        elif req.mode == Mode.INSTRUCT:
            prompt_ids = self.text.tokenize(self.text.instruct_text(req.instruct_text))
        return prompt_ids, speech

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
                f"saved voice {voice.name!r} was made for {voice.family}; this server runs {self.family}",
                field="voice_id",
            )
