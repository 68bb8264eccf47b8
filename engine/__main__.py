"""Command line: synthesise to a wav file, manage saved voices.

python -m engine synth --model DIR|ID --text "..." --prompt-wav p.wav --prompt-text "..." --out out.wav
python -m engine voices add --model DIR|ID --name alice --prompt-wav p.wav [--prompt-text "..."] [--public]
python -m engine voices list --model DIR|ID
python -m engine voices rm --model DIR|ID alice
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import soundfile as sf

from engine.config import DEMO_TINY, EngineConfig, add_device_flags, add_model_flag
from engine.errors import EngineError
from engine.request import Mode, SynthesisRequest

log = logging.getLogger("engine")

CLI_OWNER = "cli"  # the command line's own (private) voices; --public ones are everybody's
OUT_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")  # what soundfile writes, chosen by the file name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    synth = sub.add_parser("synth", help="synthesise text (or convert speech) to a wav file")
    _model_args(synth)
    synth.add_argument("--text", default="")
    synth.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.ZERO_SHOT.value)
    synth.add_argument("--prompt-wav")
    synth.add_argument("--prompt-text", default="", help="zero-shot: transcribed by the ASR when empty")
    synth.add_argument("--voice", help="a saved voice id instead of --prompt-wav")
    synth.add_argument("--instruct", default="", help="instruct mode: how to speak")
    synth.add_argument("--source-wav", help="vc mode: the speech to convert")
    synth.add_argument("--language", default="auto")
    synth.add_argument("--stream", action="store_true", help="stream chunk by chunk (prints each chunk)")
    synth.add_argument("--speed", type=float, default=1.0)
    synth.add_argument("--seed", type=int)
    synth.add_argument("--out", required=True)
    _asr_arg(synth)
    voices = sub.add_parser("voices", help="saved voices")
    vsub = voices.add_subparsers(dest="action", required=True)
    add = vsub.add_parser("add")
    _model_args(add)
    add.add_argument("--name", required=True)
    add.add_argument("--prompt-wav", required=True)
    add.add_argument("--prompt-text", default="", help="transcribed by the ASR when empty")
    add.add_argument("--public", action="store_true", help="visible to every visitor (read-only to them)")
    _asr_arg(add)
    _model_args(vsub.add_parser("list"))
    rm = vsub.add_parser("rm")
    _model_args(rm)
    rm.add_argument("voice_id")
    rm.add_argument("--public", action="store_true", help="remove a public voice")
    return p


def _asr_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--asr-model", default="auto", help="Whisper for missing transcripts: auto, a hub id or dir, none"
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    add_device_flags(p, llm_variant=True)
    p.add_argument("--voices-dir")


def _engine(args: argparse.Namespace):
    from engine.serving.engine import TTSEngine

    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        backend=args.backend,
        llm_variant=args.llm_variant,
        voices_dir=args.voices_dir,
        asr_model=args.asr_model if _needs_transcript(args) else "none",  # Whisper only when it is used
    )
    model_dir = None
    if args.model == DEMO_TINY:  # as the server does: the tiny random-weight model, built offline
        from engine.demo.make_model import demo_tiny

        cfg, model_dir = demo_tiny(cfg)
    engine = TTSEngine.load(cfg, model_dir=model_dir)
    engine.ready = True
    return engine


def _needs_transcript(args: argparse.Namespace) -> bool:
    """A zero-shot synth or a voice to save, with prompt audio and no transcript."""
    if getattr(args, "prompt_text", None) is None or not getattr(args, "prompt_wav", None):
        return False
    zero_shot = args.command == "voices" or args.mode == Mode.ZERO_SHOT.value
    return zero_shot and not args.prompt_text.strip()


def _request(args: argparse.Namespace) -> SynthesisRequest:
    return SynthesisRequest(
        text=args.text,
        mode=Mode(args.mode),
        prompt_wav=args.prompt_wav,
        prompt_text=args.prompt_text,
        voice_id=args.voice,
        voice_owner=CLI_OWNER,
        instruct_text=args.instruct,
        source_wav=args.source_wav,
        language=args.language,
        stream=args.stream,
        speed=args.speed,
        seed=args.seed,
    )


def _check_out(path: str) -> None:
    """Refuse an unwritable --out before the model loads, not after the synthesis."""
    out = Path(path)
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise ValueError(f"--out {path!r}: the file name must end in {', '.join(OUT_SUFFIXES)}")
    if not out.parent.is_dir():
        raise ValueError(f"--out {path!r}: the directory {str(out.parent)!r} does not exist")


async def _synth(args: argparse.Namespace) -> None:
    req = _request(args)  # bad flags fail here, before the model loads
    if req.mode != Mode.VC and not req.text.strip():
        raise ValueError("the text to speak is empty")  # before loading a model (or a Whisper) for nothing
    _check_out(args.out)
    engine = _engine(args)
    try:
        if req.mode == Mode.ZERO_SHOT and req.prompt_wav and not req.prompt_text.strip():
            heard = await engine.transcribe(req.prompt_wav, None)
            log.info("transcribed the prompt (%s): %s", heard.language, heard.text)
            req = replace(req, prompt_text=heard.text)
        parts = []
        async for chunk in engine.stream(req):
            parts.append(chunk.pcm)
            if args.stream and chunk.pcm.size:
                log.info("chunk %d: %.2f s of audio", chunk.index, chunk.seconds)
            last = chunk
        sf.write(args.out, np.concatenate(parts), engine.sample_rate)
        m = last.metrics
        summary = asdict(m) | {"rtf": m.rtf, "out": args.out}
        print(json.dumps(summary, indent=2))  # the metrics are this command's output
    finally:
        engine.close()


def _voices(args: argparse.Namespace) -> None:
    engine = _engine(args)
    try:
        owner = None if getattr(args, "public", False) else CLI_OWNER
        if args.action == "add":
            text = args.prompt_text.strip() or asyncio.run(engine.transcribe(args.prompt_wav, None)).text
            voice = engine.add_voice(args.name, args.prompt_wav, text, owner)
            print(f"saved {voice.id} ({voice.duration_s:.1f} s, {'public' if voice.public else 'private'})")
        elif args.action == "list":
            for v in engine.list_voices(CLI_OWNER):
                scope = "example" if v.example else "public" if v.public else "private"
                print(f"{v.id}\t{v.name}\t{scope}\t{v.family}\t{v.duration_s:.1f} s\t{v.prompt_text}")
        else:
            engine.delete_voice(args.voice_id, owner)
            print(f"deleted {args.voice_id}")
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "synth":
            asyncio.run(_synth(args))
        else:
            _voices(args)
    except (EngineError, ValueError, OSError, sf.LibsndfileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
