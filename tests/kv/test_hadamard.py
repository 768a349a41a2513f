import pytest
import torch

from xinfer.kv import hadamard


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_is_orthonormal_and_inverted_exactly(head_dim):
    x = torch.randn(32, 4, head_dim)
    y = hadamard.rotate(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard.unrotate(y), x, rtol=0, atol=1e-5)
    matrix = hadamard.rotate(torch.eye(head_dim))
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(head_dim), rtol=0, atol=1e-5)


def test_hadamard_matches_sylvester_matrix():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h = h2
    for _ in range(5):
        h = torch.kron(h, h2)
    x = torch.randn(3, 64)
    torch.testing.assert_close(hadamard.hadamard(x), x @ h.T / 8, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotated_query_key_products_are_unchanged(head_dim):
    q, k = torch.randn(16, head_dim), torch.randn(40, head_dim)
    scores = q @ k.T
    rotated = hadamard.rotate(q) @ hadamard.rotate(k).T
    torch.testing.assert_close(rotated, scores, rtol=1e-5, atol=1e-4 * head_dim**0.5)


def test_signs_are_fixed_and_mixed():
    s = hadamard.signs(128)
    assert torch.equal(s, hadamard.signs(128))
    assert set(s.tolist()) == {-1.0, 1.0} and 30 < (s > 0).sum() < 98


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_matrix_is_the_fast_transform_of_the_sign_flip(head_dim):
    x = torch.randn(16, 3, head_dim)
    torch.testing.assert_close(hadamard.rotate(x), hadamard.hadamard(x * hadamard.signs(head_dim)), rtol=0, atol=1e-5)
