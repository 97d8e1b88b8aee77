#!/usr/bin/env bash
# Builds the virtual environment with a real verl (0.9.1, PyPI) for tests/integrations/test_integrations.py, which
# scores a hand-built batch through verl's own BatchRewardManager with integrations/verl.py's
# compute_score. It sees this environment's packages (torch, the project's requirements) and adds
# verl and what its reward path imports, at the versions verl 0.9.1 accepts (transformers < 5.11).
#   VERL_VENV   where to build it (default: .venv-verl in the repository, ignored by git)
# Idempotent: a venv whose verl reward manager imports is left as it is. About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VERL_VENV:-$PWD/.venv-verl}
check="from verl.workers.reward_manager.batch import BatchRewardManager"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "verl venv ready: $venv"; exit 0
fi
rm -rf "$venv"
python -m venv --system-site-packages "$venv"
constraints=$(mktemp)
echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > "$constraints"
# verl itself without its GPU stack (vllm, flash-attn); the reward path's imports pinned below.
"$venv/bin/python" -m pip install -q --no-deps verl==0.9.1
"$venv/bin/python" -m pip install -q -c "$constraints" ray==2.60.0 omegaconf hydra-core \
  "tensordict>=0.8,<=0.10" "transformers>=5.5.3,<5.11" torchdata dill codetiming pylatexenc pybind11
"$venv/bin/python" -c "$check; import verl; print('verl', verl.__version__)"
