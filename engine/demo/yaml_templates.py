"""The model part of the released cosyvoice2.yaml / cosyvoice3.yaml, with the sizes as parameters.

Text produced here has the released structure (HyperPyYAML tags, ``!ref`` links), so our loader reads a
builder-made directory exactly as it reads a downloaded one. Values not parameterised are the released ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

HEADER = """# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: 24000
llm_input_size: {llm}
llm_output_size: {llm}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

# stream related params
chunk_size: 25 # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

llm: !new:cosyvoice.llm.llm.{llm_class}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1
"""

CFM = """    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
"""

FLOW_V2 = """flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {enc}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {enc}
        attention_heads: {enc_heads}
        linear_units: {enc_units}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {enc}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
{cfm}        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{unet}]
            dropout: 0.0
            attention_head_dim: {unet_head}
            n_blocks: {unet_blocks}
            num_mid_blocks: {unet_mid}
            num_heads: {unet_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>
"""

FLOW_V3 = """flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {pre}
        pre_lookahead_len: 3
{cfm}        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit}
            depth: {dit_depth}
            heads: {dit_heads}
            dim_head: {dit_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>
"""

HIFT = """hift: !new:cosyvoice.hifigan.generator.{hift_class}
    in_channels: 80
    base_channels: {hift}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
{extra}    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.{f0_class}
        num_class: 1
        in_channels: 80
        cond_channels: {f0}
"""


@dataclass(frozen=True)
class Sizes:
    """Every size the builder varies; the defaults are the released checkpoints'."""

    llm: int = 896
    llm_layers: int = 24
    llm_heads: int = 14
    llm_kv_heads: int = 2
    llm_ffn: int = 4864
    enc: int = 512
    enc_heads: int = 8
    enc_units: int = 2048
    enc_blocks: int = 6
    unet: int = 256
    unet_head: int = 64
    unet_blocks: int = 4
    unet_mid: int = 12
    unet_heads: int = 8
    pre: int = 1024
    dit: int = 1024
    dit_depth: int = 22
    dit_heads: int = 16
    dit_head: int = 64
    hift: int = 512
    f0: int = 512


FULL = Sizes()
TINY = Sizes(
    llm=16,
    llm_layers=2,
    llm_heads=2,
    llm_kv_heads=1,
    llm_ffn=32,
    enc=64,
    enc_heads=4,
    enc_units=128,
    enc_blocks=2,
    unet=64,
    unet_head=16,
    unet_blocks=1,
    unet_mid=2,
    unet_heads=4,
    pre=64,
    dit=64,
    dit_depth=2,
    dit_heads=4,
    dit_head=16,
    hift=64,
    f0=32,
)


def model_yaml(family: str, s: Sizes) -> str:
    """The yaml text of ``family`` ('cosyvoice2' | 'cosyvoice3') at sizes ``s``."""
    v3 = family == "cosyvoice3"
    head = HEADER.format(llm=s.llm, llm_class="CosyVoice3LM" if v3 else "Qwen2LM")
    flow = (FLOW_V3 if v3 else FLOW_V2).format(cfm=CFM, **s.__dict__)
    hift = HIFT.format(
        hift_class="CausalHiFTGenerator" if v3 else "HiFTGenerator",
        f0_class="CausalConvRNNF0Predictor" if v3 else "ConvRNNF0Predictor",
        extra="    conv_pre_look_right: 4\n" if v3 else "",
        hift=s.hift,
        f0=s.f0,
    )
    return "\n".join([head, flow, hift])


def qwen_config(s: Sizes) -> dict:
    """CosyVoice-BlankEN/config.json for a Qwen2 backbone of these sizes (text vocab as released)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": s.llm,
        "initializer_range": 0.02,
        "intermediate_size": s.llm_ffn,
        "max_position_embeddings": 32768,
        "max_window_layers": s.llm_layers,
        "model_type": "qwen2",
        "num_attention_heads": s.llm_heads,
        "num_hidden_layers": s.llm_layers,
        "num_key_value_heads": s.llm_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


# TINY with an LM vLLM can compile in float32: its attention kernels need a head dim of at least 16
# (TINY's is 16 / 2 = 8). For the GPU tests of the vLLM backend.
SMALL = replace(TINY, llm=64, llm_heads=4, llm_ffn=128)
