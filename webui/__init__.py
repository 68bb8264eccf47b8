"""The Gradio studio: ``layout.build_demo(engine, ui_lang, limits)`` -> ``gr.Blocks`` (see layout.py).

Import the submodules directly; this package imports nothing so ``webui.views`` stays light.
"""
