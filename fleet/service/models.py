"""The builds the fleet holds: a bundle checked with the agent's own reader, signed into the TUF repository, listed,
answered as the API's schema models; their SQL is fleet.queries.models."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from ...protocol.bundle import check_bundle
from ...protocol.errors import ContractError
from ...protocol.manifest import version_key
from ...protocol.profile import list_profiles
from .. import schemas as out
from ..db import Model
from ..errors import BadRequest, Conflict, RepositoryError
from ..keys import bundle_target
from ..queries import models as queries
from ..tuf_repo import Repository
from .common import iso


class ModelService:
    def __init__(self, sessions: sessionmaker, repo: Repository):
        self.sessions = sessions
        self.repo = repo

    def upload_bundle(self, path: Path) -> out.ModelBuild:
        """Check the whole archive with the agent's own reader (protocol.bundle.check_bundle: plain regular
        files only, exactly the ones the manifest lists with their sizes and sha256, a profile this fleet
        knows) before anything is signed or stored; a bad one is a 422 naming the problem (never ``path``,
        the server's temporary file). The delegated layout too: CI's signature says who built it, not that
        the archive is sound."""
        try:
            manifest = check_bundle(path, profiles=list_profiles(), label="upload")
        except ContractError as exc:  # BundleError, SchemaError, UnsupportedVersionError
            raise BadRequest(f"not a valid bundle: {exc}", 422) from exc
        if not manifest.accuracy.passed:
            raise BadRequest(f"{manifest.name} {manifest.version} failed its accuracy gate at compile time "
                             f"(drop {manifest.accuracy.drop:.4f} > {manifest.accuracy.max_drop:.4f}); "
                             "the fleet does not publish it", 422)
        target_path, custom = bundle_target(manifest)
        if self.repo.delegated() and not self.repo.is_signed(target_path):
            raise BadRequest(f"this fleet does not sign bundles (the CI key does): upload with 'edgefleet fleet "
                             f"upload BUNDLE --sign-key ci/bundles.key', which signs {target_path} first", 422)
        with self.sessions() as s:
            if queries.build(s, manifest.name, manifest.version, manifest.profile) is not None:
                raise Conflict(f"{manifest.name} {manifest.version} for {manifest.profile} is already uploaded; "
                               "bump the version to publish a new build")
        try:
            info = self.repo.add_target(target_path, path, custom.signed_fields())
            with self.sessions.begin() as s:
                return self._model(queries.add_build(s, manifest, target_path, info["sha256"], info["length"]))
        except (RepositoryError, IntegrityError) as exc:  # a concurrent upload of the same version won
            raise Conflict(f"{manifest.name} {manifest.version} for {manifest.profile} was uploaded concurrently "
                           f"with other content or is already registered: {exc}") from exc

    @staticmethod
    def _model(m: Model) -> out.ModelBuild:
        """The build as the API shows it (the manifest's own parts are the protocol's models)."""
        man = m.manifest
        return out.ModelBuild(id=m.id, name=m.name, version=m.version, profile=m.profile, backend=m.backend,
                              precision=m.precision, target=m.target_path, sha256=m.sha256, size_bytes=m.size_bytes,
                              accuracy=man["accuracy"], uploaded_at=iso(m.uploaded_at),
                              cpu_features=man.get("cpu_features", []), quantization=man.get("quantization"),
                              precision_choice=man.get("precision_choice"),
                              selftest_summary=man.get("selftest_summary"))

    def list_models(self) -> list[out.ModelBuild]:
        with self.sessions() as s:
            models = queries.builds(s)
        models.sort(key=lambda m: (m.name, version_key(m.version), m.profile))
        return [self._model(m) for m in models]
