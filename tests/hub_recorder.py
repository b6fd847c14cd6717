"""A stand-in for the Hugging Face Hub in tests: the huggingface_hub client's calls that would reach the
network are replaced, and the commits it would make are recorded (path in repo -> bytes), as is every call
in order (`calls`: (method, repo_id), reads included)."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
import huggingface_hub._upload_pipeline
from huggingface_hub import ModelCard


class Hub:
    """Stands in for the Hub: records what the client would send."""

    def __init__(self, monkeypatch, files=(), card: str | None = None):
        self.commits = []
        self.calls = []
        self.files = set(files) | ({"README.md"} if card is not None else set())
        self.card = card
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.calls.append(("create_repo", repo_id))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def create_commit(api, repo_id, operations, **kwargs):
            hub.calls.append(("create_commit", repo_id))
            hub.commits.append(
                {
                    "repo_id": repo_id,
                    "files": {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations},
                    **kwargs,
                }
            )
            return huggingface_hub.CommitInfo(
                commit_url=f"https://huggingface.co/{repo_id}/commit/1",
                commit_message="",
                commit_description="",
                oid="1",
            )

        def file_exists(api, repo_id, filename, **kwargs):
            hub.calls.append(("file_exists", repo_id))
            return filename in hub.files

        def load(cls, repo_id_or_path, **kwargs):
            if os.path.exists(repo_id_or_path):
                return original_load.__func__(cls, repo_id_or_path, **kwargs)
            hub.calls.append(("load_card", repo_id_or_path))
            return ModelCard(hub.card)

        def pipelined_upload(api, *, repo_id, add_operations, delete_operations, **kwargs):
            return create_commit(api, repo_id, [*delete_operations, *add_operations], **kwargs)

        original_load = ModelCard.load
        # upload_folder with hf_xet installed streams batches of commits; the operations are the same
        monkeypatch.setattr(huggingface_hub._upload_pipeline, "pipelined_upload", pipelined_upload)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
        monkeypatch.setattr(huggingface_hub.HfApi, "file_exists", file_exists)
        monkeypatch.setattr(ModelCard, "load", classmethod(load))
        # upload_folder asks the Hub to validate a README's metadata; here it is parsed locally instead
        monkeypatch.setattr(
            huggingface_hub.HfApi, "_validate_yaml", lambda api, content, **kw: ModelCard(content)
        )

    def readme(self) -> str:
        return self.commits[-1]["files"]["README.md"].decode()
