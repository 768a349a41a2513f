import pytest

from tests.server.live import LiveServer

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 1_000_000


@pytest.fixture(scope="session")
def server():
    """The embedded default model behind an API key."""
    live = LiveServer(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        api_key=API_KEY,
        name="server",
    ).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client(timeout=120)


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id
