"""The engine's reserved KV cache holds what transformers' growing ``DynamicLayer`` holds, and drops rows in place."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from lit_rl.rollout.kv_cache import ReservedLayer, keep_rows


def kv(rows: int, positions: int, step: int) -> torch.Tensor:
    """Distinct values per row, position and step: [rows, 2 heads, positions, 3]."""
    base = torch.arange(rows * 2 * positions * 3, dtype=torch.float32).reshape(rows, 2, positions, 3)
    return base + 1000.0 * step


def assert_same(layer: ReservedLayer, reference: DynamicLayer) -> None:
    assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)
    assert layer.get_seq_length() == reference.get_seq_length()


@pytest.mark.parametrize("capacity", [3, 16])  # 3: too small, grows mid-run
def test_reserved_layer_matches_a_growing_layer_through_repeats_drops_and_growth(capacity):
    layer, reference = ReservedLayer(capacity), DynamicLayer()
    k = kv(2, 2, 0)
    for cache in (layer, reference):
        cache.update(k, -k)
    selections = [
        torch.tensor([0, 0, 0, 1, 1, 1]),  # a prefilled prompt repeated to its G rows
        torch.tensor([0, 1, 2, 3, 4]),  # the last row leaves
        torch.tensor([0, 2, 3, 4]),  # a middle row leaves
        torch.tensor([3, 1, 2]),  # the first row leaves, the last fills its place (``keep_rows``' order)
        torch.tensor([0, 2]),
    ]
    for step, indices in enumerate(selections, start=1):
        for cache in (layer, reference):
            cache.batch_select_indices(indices)
        assert_same(layer, reference)
        k = kv(indices.numel(), 1, step)
        for cache in (layer, reference):
            out_k, out_v = cache.update(k, -k)
        assert torch.equal(out_k, reference.keys) and torch.equal(out_v, -reference.keys)
        assert_same(layer, reference)
    assert layer.keys.shape == (2, 2, 7, 3)


def test_keep_rows_fills_the_holes_below_the_new_size_with_the_rows_above_it():
    done = torch.tensor([False, True, False, True, False, False])
    assert keep_rows(done).tolist() == [0, 4, 2, 5]  # rows 0 and 2 stay; 4 and 5 fill the holes at 1 and 3
    assert keep_rows(torch.tensor([False, False, True])).tolist() == [0, 1]  # the last row leaves: none move
    assert keep_rows(torch.tensor([True, True])).numel() == 0
    done = torch.rand(64, generator=torch.Generator().manual_seed(0)) < 0.3
    keep = keep_rows(done)
    assert sorted(keep.tolist()) == (~done).nonzero().squeeze(-1).tolist()  # every kept row, once
    moved = int((keep != torch.arange(keep.numel())).sum())
    assert moved == int(done[: keep.numel()].sum())  # one move per hole below the new size


def test_dropping_rows_moves_only_the_rows_whose_place_changes_inside_the_same_buffer():
    layer = ReservedLayer(capacity=8)
    k = kv(4, 3, 0)
    layer.update(k, -k)
    buffer = layer._keys
    row0, row1 = layer.keys[0].clone(), layer.keys[1].clone()

    layer.batch_select_indices(torch.tensor([0, 1, 2]))  # the last row leaves: nothing moves
    assert layer._keys is buffer and torch.equal(layer.keys, k[:3])

    layer.batch_select_indices(keep_rows(torch.tensor([False, True, False])))  # row 1 leaves: row 2 fills it
    assert layer._keys is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    assert torch.equal(layer.keys[0], row0) and torch.equal(layer.keys[1], k[2])
    assert not torch.equal(layer.keys[1], row1)
    assert torch.equal(layer.values, -layer.keys)

    nxt = kv(2, 1, 1)
    layer.update(nxt, -nxt)  # the next position of the two live rows, in the same buffer
    assert layer._keys is buffer
    assert torch.equal(layer.keys, torch.cat([torch.stack([k[0], k[2]]), nxt], dim=-2))


def test_an_update_with_another_row_count_is_refused():
    layer = ReservedLayer(capacity=8)
    layer.update(kv(3, 2, 0), kv(3, 2, 0))
    with pytest.raises(ValueError, match="holds 3 rows but update got 2"):
        layer.update(kv(2, 1, 1), kv(2, 1, 1))


def test_merge_rows_places_the_joining_rows_beside_the_live_ones_right_aligned(tiny):
    """Two live rows of 4 columns whose first column is padding in both (a row that left used it) and one joining
    row of 2 positions: the merged cache drops the dead column, is 3 wide, keeps every live position's keys and
    values bit for bit in the same place from the right, puts the joining row's 2 positions in the last 2 columns
    (zeros left of them) and reserves ``room`` more positions; the mask is the two masks right-aligned."""
    from lit_rl.rollout.kv_cache import merge_rows, reserved_cache
    from lit_rl.rollout.torch_engine import TorchEngine

    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id, [11])
    layers = len(model.model.layers)
    live, joining = reserved_cache(8), reserved_cache(8)
    for index in range(layers):
        live.update(kv(2, 4, index), -kv(2, 4, index), index)
        joining.update(kv(1, 2, index) + 0.5, -kv(1, 2, index) - 0.5, index)
    live_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    merged, mask = merge_rows(engine, live, live_mask, joining, torch.tensor([[1, 1]]), room=5)
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 1, 1]]
    for index, layer in enumerate(merged.layers):
        assert layer.keys.shape == (3, 2, 3, 3) and layer.capacity == 3 + 5
        assert torch.equal(layer.keys[:2], kv(2, 4, index)[:, :, 1:].to(layer.keys.dtype))
        assert torch.equal(layer.values[:2], -kv(2, 4, index)[:, :, 1:].to(layer.values.dtype))
        assert torch.equal(layer.keys[2, :, 1:], (kv(1, 2, index)[0] + 0.5).to(layer.keys.dtype))
        assert not layer.keys[2, :, 0].any()
