"""Token maps (--speculative-token-map): an EAGLE head drafts only the map's target tokens and
reads only their LM head rows; bad maps and heads a map cannot apply to are refused clearly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.args import parse_args
from engine.models.loader import CheckpointError, load_draft, load_model
from tests.checkpoints import random_head, random_target

VOCAB = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("token_map")
    target = random_target(base / "target", vocab=VOCAB, hidden=32, layers=2)
    return {"target": target, "eagle": random_head(base / "eagle", target),
            "eagle3-reduced": random_head(base / "eagle3", target, eagle3=True, draft_vocab=24)}


def save_map(path: Path, ids) -> Path:
    torch.save(ids, path)
    return path


def test_a_mapped_head_drafts_the_map_rows_of_the_full_head(folders, tmp_path):
    target, _ = load_model(folders["target"])
    hot = [40, 3, 17, 5, 63, 0]                                   # any order; the loader sorts
    full, _ = load_draft(folders["eagle"], target)
    mapped, _ = load_draft(folders["eagle"], target, token_map=save_map(tmp_path / "map.pt", hot))
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor(sorted(hot))
    assert mapped.compute_logits(hidden).shape == (3, len(hot))
    torch.testing.assert_close(mapped.compute_logits(hidden), full.compute_logits(hidden)[:, ids])
    assert torch.equal(mapped.draft_to_target(torch.arange(len(hot))), ids)
    assert full.hot_ids is None and torch.equal(full.draft_to_target(torch.arange(4)), torch.arange(4))
    # the map above was a list of ints; a tensor of the same ids loads the same
    tensor_map, _ = load_draft(folders["eagle"], target, token_map=save_map(tmp_path / "tensor.pt", torch.tensor(hot)))
    assert torch.equal(tensor_map.hot_ids, ids)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("not ids", "not a torch.save'd list or tensor"),
    (torch.zeros(2, 3, dtype=torch.long), "1-D list of integer token ids"),
    (torch.tensor([1.0, 2.0]), "1-D list of integer token ids"),
    ([], "1-D list of integer token ids"),
    ([1, 2, VOCAB], "outside the target vocabulary"),
    ([-1, 2], "outside the target vocabulary"),
    ([4, 7, 4], "repeats token ids"),
])
def test_bad_token_maps_are_refused(folders, tmp_path, content, message):
    target, _ = load_model(folders["target"])
    path = tmp_path / "map.pt"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        save_map(path, content)
    with pytest.raises(CheckpointError, match=message):
        load_draft(folders["eagle"], target, token_map=path)


def test_a_head_with_its_own_draft_vocabulary_refuses_a_map(folders, tmp_path):
    target, _ = load_model(folders["target"])
    with pytest.raises(CheckpointError, match="its own vocabulary of 24 tokens"):
        load_draft(folders["eagle3-reduced"], target, token_map=save_map(tmp_path / "map.pt", [1, 2, 3]))
    target.set_aux_capture_layers([])


def test_the_flag_resolves_for_eagle_heads_only():
    assert parse_args([]).token_map_path is None                                    # the whole vocabulary
    assert parse_args(["--speculative-token-map", "/x/map.pt"]).token_map_path == "/x/map.pt"
    assert parse_args(["--speculative-token-map", "none"]).token_map_path is None
    assert parse_args(["--speculative-algorithm", "eagle3", "--speculative-token-map", "/x/m.pt"]).token_map_path


def test_a_map_for_an_algorithm_without_a_head_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--speculative-algorithm", "ngram", "--speculative-token-map", "/x/map.pt"])
    assert "applies to EAGLE / EAGLE-3 heads" in capsys.readouterr().err
