"""Every user-facing string of the web UI in English and Chinese; ``Texts(lang)(key, **fields)`` looks one up.

Keys are shared by both languages (tests check the two tables have the same keys and the same ``{fields}``).
``ui_lang`` "auto" follows the browser: labels through Gradio's i18n (``i18n``), the rest (notes, errors,
readouts) through the request's Accept-Language (``browser_lang``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gradio as gr

UI_LANGS = ("zh", "en")
UI_LANG_CHOICES = ("auto", *UI_LANGS)  # auto: follow the browser
I18N_PREFIX = "cosy_"  # keeps our keys apart from Gradio's own translation keys

EN: dict[str, str] = {
    "title": "CosyStream Studio",
    "subtitle": "Streaming voice cloning with live latency readouts",
    "banner_random": "Demo model with RANDOM weights: the audio is noise. Everything else (streaming, "
    "metrics, queueing) is real. Start with a released checkpoint (--model) for speech.",
    "mode": "Mode",
    "mode_zero_shot": "Zero-shot clone",
    "mode_cross_lingual": "Cross-lingual",
    "mode_instruct": "Instruct",
    "mode_vc": "Voice conversion",
    "mode_voice": "Saved voice",
    "mode_help_zero_shot": "Clone the prompt voice; the transcript of the prompt is required.",
    "mode_help_cross_lingual": "Clone the voice into another language; no transcript needed.",
    "mode_help_instruct": "Clone the voice and steer its dialect, emotion or style by an instruction.",
    "mode_help_vc": "Re-speak the source recording in the prompt's voice; no text needed.",
    "mode_help_voice": "Speak with a voice saved earlier (its prompt features are cached).",
    "voice_group": "Voice",
    "prompt_audio": "Prompt audio (3-30 s)",
    "prompt_none": "No prompt yet: upload or record 3-30 s of clean speech.",
    "prompt_ok": "{seconds:.1f} s · {rate} Hz · ok",
    "prompt_short": "{seconds:.1f} s: too short, use at least {min_s:.0f} s of speech.",
    "prompt_long": "{seconds:.1f} s: too long, use at most {max_s:.0f} s (the speech tokenizer's limit).",
    "prompt_unreadable": "The prompt audio could not be read; try a wav, flac or mp3 file.",
    "prompt_text": "Transcript of the prompt audio",
    "prompt_text_ph": "Exactly what is said in the prompt. The v3 system prompt is added for you.",
    "save_name": "Save this prompt as",
    "save_name_ph": "voice name, e.g. alice",
    "save_btn": "Save voice",
    "saved_as": "Saved voice “{name}”.",
    "deleted": "Deleted voice “{name}”.",
    "saved_voice": "Saved voice",
    "delete_btn": "Delete",
    "source_audio": "Source speech to convert",
    "instruct_preset": "Instruction presets",
    "instruct_text": "Instruction",
    "instruct_ph": "e.g. Speak as fast as you can, full of excitement.",
    "text_group": "Text",
    "language": "Language",
    "lang_auto": "Auto",
    "lang_zh": "中文 (Chinese)",
    "lang_en": "English",
    "lang_ja": "日本語 (Japanese)",
    "lang_ko": "한국어 (Korean)",
    "lang_yue": "粵語 (Cantonese)",
    "text": "Text to speak",
    "text_ph": "Type or paste text; long text is split into segments and streamed.",
    "counter": "{chars} / {limit} characters · segments: {segments}",
    "split_preview": "Split preview",
    "settings": "Settings",
    "streaming": "Stream",
    "streaming_info": "Play while generating",
    "live_text": "Live text",
    "live_text_info": "Speak the text while it is written: the box's words at the rate below, then what "
    "you type (first sound counts from the first word)",
    "live_wps": "Words per second",
    "speed": "Speed",
    "seed": "Seed",
    "seed_info": "-1 = new random seed each time",
    "dice": "Random seed",
    "generate": "Generate",
    "stop": "Stop",
    "examples": "Examples",
    "live": "Live stream",
    "live_idle": "idle",
    "live_waiting": "waiting for audio…",
    "live_streaming": "streaming",
    "live_playing": "playing",
    "live_done": "done",
    "live_stopped": "stopped",
    "live_error": "interrupted",
    "live_first": "click → first sound",
    "live_received": "received",
    "live_underruns": "underruns",
    "final_audio": "Result",
    "metrics": "This request",
    "ttfa_server": "First audio · server",
    "ttfa_browser": "First sound · browser",
    "rtf": "RTF",
    "tokens_s": "Tokens/s",
    "lm_tokens": "Tokens",
    "request_id": "Request",
    "queue_wait": "Queued",
    "audio_len": "Audio",
    "elapsed": "Compute",
    "seed_used": "Seed",
    "stages": "Stage time (ms)",
    "ttfa_parts": "First audio, part by part (ms)",
    "part_queue": "queue",
    "part_frontend": "text + prompt",
    "part_lm": "LM to first chunk",
    "part_t2w_wait": "vocoder queue",
    "part_t2w_compute": "flow + HiFT",
    "server": "Server",
    "active": "Active streams",
    "queued": "Queued",
    "completed": "Completed",
    "memory": "Device memory",
    "throughput": "Throughput (audio s / s)",
    "peak": "peak",
    "lab_link": "Prompt lab →",
    "warming": "Warming up: the first audio may be slower for a minute or two.",
    "history": "History",
    "history_empty": "Generations of this session appear here.",
    "h_time": "Time",
    "h_mode": "Mode",
    "h_text": "Text",
    "h_settings": "Settings",
    "h_metrics": "Metrics",
    "h_files": "Download",
    "h_seed": "seed",
    "h_stream": "stream",
    "h_offline": "whole file",
    "h_upload": "upload",
    "h_ttfa": "TTFA",
    "chip_model": "model",
    "chip_family": "family",
    "chip_rate": "rate",
    "stage_frontend": "text",
    "stage_lm": "LM",
    "stage_flow": "flow",
    "stage_hift": "HiFT",
    "lang_other": "another language",
    "err_title": "Error",
    "login_hint": "Sign in with any user name and one of this server's API keys as the password.",
    "status_idle": "Ready.",
    "status_running": "Generating… {audio:.1f} s of audio so far.",
    "status_done": "Done: {audio:.1f} s of audio, seed {seed}.",
    "status_stopped": "Stopped: kept {audio:.1f} s of audio.",
    "err_no_prompt": "A prompt voice is needed: upload or record 3-30 s of speech first.",
    "err_no_prompt_text": "Zero-shot cloning needs the transcript of the prompt audio.",
    "err_no_text": "The text is empty: type what should be spoken.",
    "err_text_long": "The text has {chars} characters; the limit is {limit}. Shorten it or split it.",
    "err_no_source": "Voice conversion needs the source speech to convert.",
    "err_no_instruct": "Instruct mode needs an instruction: pick a preset or type one.",
    "err_no_voice": "Pick a saved voice first (save one from a prompt in the other modes).",
    "err_no_voice_name": "Give the voice a name first.",
    "err_bad_setting": "Invalid setting: {error}",
    "err_busy": "The server is busy: retry in {seconds} s.",
    "err_starting": "The server is still starting: retry in {seconds} s.",
    "err_stopping": "The server is shutting down, so this take was cut short. Press Retry once it is back.",
    "err_unspeakable": "The text has nothing to speak once normalised: write words, not only symbols or "
    "invisible characters.",
    "err_voice_missing": "That saved voice is gone or not yours; pick another one.",
    "lexicon": "Pronunciation",
    "lexicon_info": "A lexicon from the prompt lab: its words are said as its entries say.",
    "lexicon_none": "None",
    "lexicon_public": "{name} (public)",
    "lexicon_applied": " Pronounced from the lexicon: {words}.",
    "lexicon_applied_none": " The lexicon matched no word of this text.",
    "err_no_lexicons": "This server keeps no pronunciation lexicons; set Pronunciation to None.",
    "err_lexicon": "That lexicon cannot be used ({error}); pick another one or None.",
    "err_voice_public": "That voice is public: only the server's operator can delete it.",
    "err_prompt_bad": "The prompt audio cannot be used: {error}",
    "err_input": "The request was refused: {error}",
    "err_no_browser_id": "This page has no browser id yet; reload it (saved voices need it).",
    "err_failed": "Generation failed on the server: {error}",
    "transcribing": "Transcribing the prompt…",
    "transcribed": "Transcribed as {language}; check it and edit if needed.",
    "transcribed_noise": "Transcribed as {language} by a RANDOM-weight Whisper: the text is noise.",
    "transcribe_failed": "Could not transcribe the prompt; type the transcript.",
    "asr_off": "Automatic transcription is off on this server: type the transcript.",
    "example_voices": "Example voices (click to fill the form)",
    "voice_public": "public",
    "voice_example": "example",
    # the request's end when it fails, kept transcripts, unknown languages, unreadable files
    "status_failed": "Failed: {message}",
    "status_refused": "Not started: {message}",
    "status_failed_kept": "Failed: {message} Kept {audio:.1f} s of audio.",
    "h_failed": "failed",
    # the studio's own connection to its server (keep.js): the banner while it cannot be reached
    "conn_down": "The server cannot be reached. Your text, settings and takes are kept in this browser; "
    "the page reconnects by itself.",
    "voice_not_kept": "The saved voice “{voice}” you picked last time is no longer listed; pick another one.",
    "prompt_reupload": "Upload the prompt again: “{name}” could not be kept in this browser.",
    "kept_take": "Kept in this browser: {audio} s",
    "kept_download": "Download wav",
    "status_waiting": "Waiting for the server…",
    "status_no_answer": "Failed: the server did not answer, and nothing was made. Try again when it is back.",
    "status_lost": "Failed: the server went away during this take. What was heard is kept in the live card.",
    "retry": "Retry",
    "err_internal": "The server could not finish this request (the details are in its log). "
    "Press Retry, or change the text or the voice.",
    "transcript_kept": "Kept the transcript you typed; the recognizer heard “{text}”.",
    # the voice library (voice_library.py): example and saved voices as cards
    "library_title": "Voices (▶ to listen, the name to use it)",
    "library_example": "example",
    "library_public": "public",
    "library_own": "yours",
    "library_seconds": "{seconds:.1f} s",
    "library_play": "Play {name}",
    "library_use": "Use {name}",
    "library_rename": "Rename",
    "library_delete": "Delete",
    "library_undo": "Undo",
    "library_rename_ask": "New name for this voice:",
    "library_picked": "Using “{name}”.",
    "library_no_recording": "“{name}” has no recording kept: use it in Saved voice mode.",
    "library_restored": "Restored voice “{name}”.",
    "library_renamed": "Renamed “{old}” to “{name}”.",
    # the script desk (script_tab.py): dialogue scripts with a voice per speaker
    "script_title": "Script: dialogue, pauses, long texts",
    "script_text": "Script",
    "script_text_info": "One turn a line: 'Name: text' or 'Name (instruction): text'; a line without a name "
    "continues the speaker. Up to 20,000 characters.",
    "script_speaker": "Speaker",
    "script_voice": "voice",
    "script_gap": "Gap between turns (s)",
    "script_go": "Perform the script",
    "script_files": "Audio and subtitles (wav, SRT, WebVTT)",
    "script_prompt_voice": "the prompt box (left)",
    "script_tag_break": "exact silence (ms or s, up to 10 s)",
    "script_tag_breath": "an audible breath",
    "script_tag_quick_breath": "a short, quick breath",
    "script_tag_laughter": "a burst of laughter",
    "script_tag_laughing": "the words inside spoken while laughing",
    "script_tag_strong": "stress on the words inside",
    "script_tag_sigh": "a sigh",
    "script_tag_cough": "a cough",
    "script_tag_lipsmack": "a lip smack",
    "script_tag_mn": "a closed-mouth 'mm'",
    "script_tag_noise": "a short noise",
    "script_progress": "Sentences {done} / {total} · {audio:.1f} s of audio",
    "script_eta": " · about {left:.0f} s left",
    "script_stopped": "Stopped after sentence {done} of {total}: kept {audio:.1f} s of audio and its "
    "subtitles.",
    "script_noise": "demo-tiny has random weights: its speech is noise, so the word timings are noise too.",
    "script_err_no_voice": "speaker '{name}' has no voice: pick one",
    "script_err_no_cast": "name at least one speaker and pick a voice for it",
    "script_err_no_prompt": "'the prompt box' voice needs a prompt: upload or record one on the left",
}

ZH: dict[str, str] = {
    "title": "CosyStream 语音工作室",
    "subtitle": "流式声音克隆 · 实时延迟指标",
    "banner_random": "演示模型为随机权重：生成的音频是噪声。流式、指标、排队等其余功能都是真实的。"
    "要听到语音，请用 --model 加载发布的模型。",
    "mode": "模式",
    "mode_zero_shot": "零样本克隆",
    "mode_cross_lingual": "跨语种",
    "mode_instruct": "指令控制",
    "mode_vc": "声音转换",
    "mode_voice": "已存音色",
    "mode_help_zero_shot": "克隆参考音频的音色；需要参考音频的文本。",
    "mode_help_cross_lingual": "用参考音色说另一种语言；不需要参考文本。",
    "mode_help_instruct": "克隆音色，并用指令控制方言、情感、语速或风格。",
    "mode_help_vc": "用参考音色重新说出源音频的内容；不需要文本。",
    "mode_help_voice": "使用之前保存的音色（其参考特征已缓存）。",
    "voice_group": "音色",
    "prompt_audio": "参考音频（3-30 秒）",
    "prompt_none": "还没有参考音频：请上传或录制 3-30 秒清晰语音。",
    "prompt_ok": "{seconds:.1f} 秒 · {rate} Hz · 可用",
    "prompt_short": "{seconds:.1f} 秒：太短，至少需要 {min_s:.0f} 秒语音。",
    "prompt_long": "{seconds:.1f} 秒：太长，最多 {max_s:.0f} 秒（语音分词器的上限）。",
    "prompt_unreadable": "无法读取参考音频；请使用 wav、flac 或 mp3 文件。",
    "prompt_text": "参考音频的文本",
    "prompt_text_ph": "参考音频里说的原话。v3 的系统提示词会自动添加。",
    "save_name": "将此参考保存为",
    "save_name_ph": "音色名称，例如 小明",
    "save_btn": "保存音色",
    "saved_as": "已保存音色“{name}”。",
    "deleted": "已删除音色“{name}”。",
    "saved_voice": "已存音色",
    "delete_btn": "删除",
    "source_audio": "要转换的源音频",
    "instruct_preset": "预设指令",
    "instruct_text": "指令",
    "instruct_ph": "例如：请用尽可能快地语速说一句话。",
    "text_group": "文本",
    "language": "语言",
    "lang_auto": "自动",
    "lang_zh": "中文",
    "lang_en": "English (英语)",
    "lang_ja": "日本語 (日语)",
    "lang_ko": "한국어 (韩语)",
    "lang_yue": "粵語 (粤语)",
    "text": "合成文本",
    "text_ph": "输入或粘贴文本；长文本会自动分段并流式生成。",
    "counter": "{chars} / {limit} 字符 · 分段：{segments}",
    "split_preview": "分段预览",
    "settings": "设置",
    "streaming": "流式",
    "streaming_info": "边生成边播放",
    "live_text": "实时文本",
    "live_text_info": "边写边说：先按下方速率逐词送出文本框内容，再送出您继续输入的文字"
    "（首包时延从第一个词算起）",
    "live_wps": "每秒词数",
    "speed": "语速",
    "seed": "随机种子",
    "seed_info": "-1 = 每次随机",
    "dice": "随机种子",
    "generate": "生成",
    "stop": "停止",
    "examples": "示例",
    "live": "实时播放",
    "live_idle": "空闲",
    "live_waiting": "等待音频…",
    "live_streaming": "接收中",
    "live_playing": "播放中",
    "live_done": "完成",
    "live_stopped": "已停止",
    "live_error": "已中断",
    "live_first": "点击 → 首声",
    "live_received": "已接收",
    "live_underruns": "断流次数",
    "final_audio": "结果",
    "metrics": "本次请求",
    "ttfa_server": "首包延迟 · 服务端",
    "ttfa_browser": "首声延迟 · 浏览器",
    "rtf": "实时率",
    "tokens_s": "词元/秒",
    "lm_tokens": "词元数",
    "request_id": "请求",
    "queue_wait": "排队等待",
    "audio_len": "音频时长",
    "elapsed": "计算耗时",
    "seed_used": "所用种子",
    "stages": "各阶段耗时（毫秒）",
    "ttfa_parts": "首包耗时构成（毫秒）",
    "part_queue": "排队",
    "part_frontend": "文本与提示音",
    "part_lm": "语言模型到首块",
    "part_t2w_wait": "声码器排队",
    "part_t2w_compute": "流匹配 + HiFT",
    "server": "服务器",
    "active": "活跃流",
    "queued": "排队中",
    "completed": "已完成",
    "memory": "设备显存",
    "throughput": "吞吐（音频秒 / 秒）",
    "peak": "峰值",
    "lab_link": "提示词实验室 →",
    "warming": "正在预热：最初一两分钟的首段音频可能较慢。",
    "history": "历史记录",
    "history_empty": "本次会话的生成结果会显示在这里。",
    "h_time": "时间",
    "h_mode": "模式",
    "h_text": "文本",
    "h_settings": "设置",
    "h_metrics": "指标",
    "h_files": "下载",
    "h_seed": "种子",
    "h_stream": "流式",
    "h_offline": "整段",
    "h_upload": "上传",
    "h_ttfa": "首包",
    "chip_model": "模型",
    "chip_family": "系列",
    "chip_rate": "采样率",
    "stage_frontend": "文本",
    "stage_lm": "语言模型",
    "stage_flow": "流匹配",
    "stage_hift": "HiFT",
    "lang_other": "其他语言",
    "err_title": "出错了",
    "login_hint": "用户名任意，密码填写本服务器的一个 API 密钥。",
    "status_idle": "就绪。",
    "status_running": "生成中… 已生成 {audio:.1f} 秒音频。",
    "status_done": "完成：{audio:.1f} 秒音频，种子 {seed}。",
    "status_stopped": "已停止：保留 {audio:.1f} 秒音频。",
    "err_no_prompt": "需要参考音色：请先上传或录制 3-30 秒语音。",
    "err_no_prompt_text": "零样本克隆需要填写参考音频的文本。",
    "err_no_text": "合成文本为空：请输入要说的内容。",
    "err_text_long": "文本有 {chars} 个字符，上限为 {limit}。请缩短或分开生成。",
    "err_no_source": "声音转换需要提供源音频。",
    "err_no_instruct": "指令模式需要指令：请选择预设或自行输入。",
    "err_no_voice": "请先选择已存音色（可在其他模式下从参考音频保存）。",
    "err_no_voice_name": "请先给音色起个名字。",
    "err_bad_setting": "设置无效：{error}",
    "err_busy": "服务器繁忙，请 {seconds} 秒后重试。",
    "err_starting": "服务器仍在启动，请 {seconds} 秒后重试。",
    "err_stopping": "服务器正在关闭，本次生成被中断。服务器恢复后请点重试。",
    "err_unspeakable": "文本规范化后没有可朗读的内容：请输入文字，而不只是符号或不可见字符。",
    "err_voice_missing": "该已存音色不存在或不属于你；请选择其他音色。",
    "lexicon": "读音词典",
    "lexicon_info": "提示词实验室里的词典：其中的词按词条读。",
    "lexicon_none": "不使用",
    "lexicon_public": "{name}（公共）",
    "lexicon_applied": " 已按词典读：{words}。",
    "lexicon_applied_none": " 词典中的词未出现在本文本中。",
    "err_no_lexicons": "本服务器没有读音词典；请将读音词典设为“不使用”。",
    "err_lexicon": "无法使用该词典（{error}）；请选择其他词典或“不使用”。",
    "err_voice_public": "该音色是公共音色：只有服务器管理员可以删除。",
    "err_prompt_bad": "参考音频无法使用：{error}",
    "err_input": "请求被拒绝：{error}",
    "err_no_browser_id": "页面尚未生成浏览器标识；请刷新页面（保存音色需要它）。",
    "err_failed": "服务器生成失败：{error}",
    "transcribing": "正在识别参考音频…",
    "transcribed": "已识别为{language}；请核对并按需修改。",
    "transcribed_noise": "已由随机权重的 Whisper 识别为{language}：文本是噪声。",
    "transcribe_failed": "无法识别参考音频；请手动输入文本。",
    "asr_off": "此服务器未开启自动识别：请手动输入参考文本。",
    "example_voices": "示例音色（点击填入表单）",
    "voice_public": "公共",
    "voice_example": "示例",
    # the request's end when it fails, kept transcripts, unknown languages, unreadable files
    "status_failed": "失败：{message}",
    "status_refused": "未开始：{message}",
    "status_failed_kept": "失败：{message}已保留 {audio:.1f} 秒音频。",
    "h_failed": "失败",
    # the studio's own connection to its server (keep.js): the banner while it cannot be reached
    "conn_down": "无法连接服务器。你的文本、设置和生成记录都保存在此浏览器中；页面会自动重新连接。",
    "voice_not_kept": "上次选择的已存音色“{voice}”已不在列表中；请选择其他音色。",
    "prompt_reupload": "请重新上传参考音频：此浏览器未能保存“{name}”。",
    "kept_take": "已保存在此浏览器：{audio} 秒",
    "kept_download": "下载 wav",
    "status_waiting": "正在等待服务器…",
    "status_no_answer": "失败：服务器没有回应，未生成任何音频。请在服务器恢复后重试。",
    "status_lost": "失败：生成过程中服务器断开了。已听到的部分保存在实时播放卡片中。",
    "retry": "重试",
    "err_internal": "服务器未能完成此请求（详情见服务器日志）。请点重试，或更换文本或音色。",
    "transcript_kept": "保留了你输入的参考文本；识别结果为“{text}”。",
    # the voice library (voice_library.py): example and saved voices as cards
    "library_title": "音色库（▶ 试听，点名字使用）",
    "library_example": "示例",
    "library_public": "公共",
    "library_own": "我的",
    "library_seconds": "{seconds:.1f} 秒",
    "library_play": "试听 {name}",
    "library_use": "使用 {name}",
    "library_rename": "重命名",
    "library_delete": "删除",
    "library_undo": "撤销",
    "library_rename_ask": "此音色的新名称：",
    "library_picked": "正在使用“{name}”。",
    "library_no_recording": "“{name}”没有保存录音：请在“已存音色”模式下使用。",
    "library_restored": "已恢复音色“{name}”。",
    "library_renamed": "已将“{old}”重命名为“{name}”。",
    # the script desk (script_tab.py): dialogue scripts with a voice per speaker
    "script_title": "剧本：对话、停顿、长文本",
    "script_text": "剧本",
    "script_text_info": "每行一轮：“名字: 文本”或“名字 (指令): 文本”（半角冒号与括号）；"
    "没有名字的行接续上一位角色。最多 20,000 字符。",
    "script_speaker": "角色",
    "script_voice": "音色",
    "script_gap": "轮次间隔（s）",
    "script_go": "演绎剧本",
    "script_files": "音频与字幕（wav、SRT、WebVTT）",
    "script_prompt_voice": "参考音频框（左侧）",
    "script_tag_break": "精确的静音（ms 或 s，最长 10 s）",
    "script_tag_breath": "一次可听见的呼吸",
    "script_tag_quick_breath": "一次短促的呼吸",
    "script_tag_laughter": "一阵笑声",
    "script_tag_laughing": "其中的文字边笑边说",
    "script_tag_strong": "重读其中的文字",
    "script_tag_sigh": "一声叹息",
    "script_tag_cough": "一声咳嗽",
    "script_tag_lipsmack": "一声咂嘴",
    "script_tag_mn": "闭口的“嗯”",
    "script_tag_noise": "一声短噪音",
    "script_progress": "句子 {done} / {total} · 已生成 {audio:.1f} s 音频",
    "script_eta": " · 约剩 {left:.0f} s",
    "script_stopped": "已在第 {done} / {total} 句后停止：保留了 {audio:.1f} s 音频及其字幕。",
    "script_noise": "演示模型为随机权重：生成的语音是噪声，因此逐词时间也是噪声。",
    "script_err_no_voice": "角色“{name}”没有音色：请选择一个。",
    "script_err_no_cast": "请至少填写一个角色名并为其选择音色。",
    "script_err_no_prompt": "“参考音频框”音色需要参考音频：请在左侧上传或录制。",
}

TABLES = {"en": EN, "zh": ZH}

# (language code sent to the engine, label key); "auto" lets the engine detect the script. The labels lead
# with each language's own name: a choice list's labels are not translated by Gradio's i18n, so a value set
# by an example keeps its first label, and a native name reads right in either UI language.
LANGUAGES = ("auto", "zh", "en", "ja", "ko", "yue")
# each language's name in itself: labels the page builds once for every UI language (the example texts'
# chips: Gradio cannot translate them) read right on an English and on a Chinese page
NATIVE_NAMES = {"zh": "中文", "en": "English", "ja": "日本語", "ko": "한국어", "yue": "粵語"}

EXAMPLES = (
    ("zh", "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。"),
    ("en", "The quick brown fox jumps over the lazy dog, then streams its reply in well under a second."),
    ("ja", "今日はとても良い天気ですね。散歩に行きましょう。"),
    ("ko", "오늘 날씨가 정말 좋네요. 같이 산책하러 갈까요?"),
    ("yue", "今日天气好好，我哋一齐去饮茶啦。"),
)


# Whisper's language codes beyond LANGUAGES that a transcription may report, named in each UI language.
OTHER_LANGUAGES = {
    "de": {"en": "German", "zh": "德语"}, "fr": {"en": "French", "zh": "法语"},
    "es": {"en": "Spanish", "zh": "西班牙语"}, "it": {"en": "Italian", "zh": "意大利语"},
    "pt": {"en": "Portuguese", "zh": "葡萄牙语"}, "ru": {"en": "Russian", "zh": "俄语"},
    "ar": {"en": "Arabic", "zh": "阿拉伯语"}, "hi": {"en": "Hindi", "zh": "印地语"},
    "th": {"en": "Thai", "zh": "泰语"}, "vi": {"en": "Vietnamese", "zh": "越南语"},
    "id": {"en": "Indonesian", "zh": "印尼语"}, "tr": {"en": "Turkish", "zh": "土耳其语"},
    "nl": {"en": "Dutch", "zh": "荷兰语"}, "pl": {"en": "Polish", "zh": "波兰语"},
}  # fmt: skip


def language_name(code: str, t: Texts) -> str:
    """A language code as a name in ``t``'s language ("ja" -> "日本語 (Japanese)"); never the raw code."""
    if code in LANGUAGES:
        return t(f"lang_{code}")
    return OTHER_LANGUAGES.get(code, {}).get(t.lang) or t("lang_other")


def browser_lang(accept_language: str | None) -> str:
    """The first UI language an Accept-Language header names ("zh-CN,zh;q=0.9" -> "zh"); else English."""
    for part in (accept_language or "").split(","):
        primary = part.split(";")[0].strip().split("-")[0].lower()
        if primary in UI_LANGS:
            return primary
    return "en"


def i18n() -> gr.I18n:
    """Gradio's i18n tables (labels, placeholders, buttons): the browser's language picks one."""
    import gradio as gr  # here, not at import: app.py reads UI_LANG_CHOICES without loading Gradio

    tables = {lang: {I18N_PREFIX + k: v for k, v in table.items()} for lang, table in TABLES.items()}
    return gr.I18n(**tables)


class Texts:
    """Label lookup for one UI language; unknown keys fail loudly so typos surface in tests."""

    def __init__(self, lang: str = "zh"):
        if lang not in TABLES:
            raise ValueError(f"ui language must be one of {UI_LANGS}, got {lang!r}")
        self.lang, self._table = lang, TABLES[lang]

    def __call__(self, key: str, **fields: object) -> str:
        return self._table[key].format(**fields) if fields else self._table[key]


class Labels:
    """Component labels: the fixed language's strings, or (``auto``) Gradio i18n keys the browser resolves."""

    def __init__(self, ui_lang: str):
        if ui_lang not in UI_LANG_CHOICES:
            raise ValueError(f"ui language must be one of {UI_LANG_CHOICES}, got {ui_lang!r}")
        self.auto = ui_lang == "auto"
        self.texts = Texts("en" if self.auto else ui_lang)
        self._i18n = i18n() if self.auto else None

    def __call__(self, key: str) -> Any:
        if self._i18n is not None:
            self.texts(key)  # unknown keys fail here, as with fixed strings
            return self._i18n(I18N_PREFIX + key)
        return self.texts(key)
