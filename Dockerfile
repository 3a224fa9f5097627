# The image the KubeRay manifests run (clusters/kuberay-raycluster.yaml, kuberay-rayjob.yaml):
# Ray's GPU image with raycl, its GPU extra and the cloud-storage clients MLflow's artifact proxy
# needs. Build it from the repository root and push it where your Kubernetes cluster pulls from:
#
#   docker build --build-arg RAYCL_GIT_COMMIT=$(git rev-parse HEAD) -t YOUR-REGISTRY/raycl:0.1.0 .
#   docker push YOUR-REGISTRY/raycl:0.1.0
#
# The tag above is the one the manifests name, and its version is raycl's (pyproject.toml);
# tests/test_clusters.py checks both, that the base image's Ray is the Ray raycl is tested with,
# and performs this file's `pip install` (resolved against the package index) without Docker.
FROM rayproject/ray:2.60.0-py311-gpu

# The checkout (.dockerignore leaves out what .gitignore does, and .git): the containers' working
# directory, and the RayJob's working_dir, where `python -m raycl.tune searches/...` finds the
# search files. Made by the image's user (ray), not by WORKDIR (which would make it root's):
# `pip install .` builds in it.
RUN mkdir -p /home/ray/raycl
WORKDIR /home/ray/raycl
COPY --chown=ray:users . .

# Ray is pinned to the base image's version so pip never moves it; boto3 / google-cloud-storage
# let `python -m raycl.server` proxy artifacts to s3:// / gs://. faiss-cpu (a core dependency)
# and faiss-gpu (the gpu extra) install the same `faiss` package: the check fails the build if
# the CPU build ended up on top.
RUN pip install --no-cache-dir "ray[default,train,tune]==2.60.0" ".[gpu]" boto3 google-cloud-storage \
    && python -c "import faiss; faiss.StandardGpuResources"

# MLflow records this as the runs' git commit (the image has no .git). Set with --build-arg.
ARG RAYCL_GIT_COMMIT=""
ENV RAYCL_GIT_COMMIT=${RAYCL_GIT_COMMIT}
