"""How one rank runs its expert FFN, chosen once per (config, shape): the rules of
``functional.expert_ffn`` (CPU only)."""

from megatron_mok import MoKConfig
from megatron_mok.functional import expert_ffn
from megatron_mok.functional.validate import MoEShape


def _shape(tokens, experts, topk=8, hidden=7168, ffn=2048):
    return MoEShape(tokens=tokens, hidden=hidden, topk=topk, experts_per_rank=experts, ffn_hidden=ffn)


def test_fc1_data_gradient_takes_64_row_tiles_where_experts_are_small():
    expert_ffn.expert_call.cache_clear()
    config = MoKConfig()
    # Kimi-K2, 4096 tokens: 192 experts per GPU is ~170 rows per expert, 48 is ~683
    small = expert_ffn.expert_call(config, _shape(4096, 192), 2, 128)
    assert small.fc1_dgrad_block_m == 64 and not small.push_from_gemm
    assert expert_ffn.expert_call(config, _shape(4096, 48), 8, 128).fc1_dgrad_block_m == 0
    # the bound itself takes them (DeepSeek-V3 at EP 2: 256 rows per expert)
    assert expert_ffn.expert_call(config, _shape(4096, 128), 2, 128).fc1_dgrad_block_m == 64
    assert expert_ffn.expert_call(config, _shape(4096 + 1, 128), 2, 128).fc1_dgrad_block_m == 0
    # 64-row segments have no padding-only half; torch's GEMMs (H not a multiple of 256) none at all
    assert expert_ffn.expert_call(config, _shape(4096, 192), 2, 64).fc1_dgrad_block_m == 0
    assert expert_ffn.expert_call(config, _shape(4096, 192, hidden=7000), 2, 128).fc1_dgrad_block_m == 0
    expert_ffn.expert_call.cache_clear()
