"""optax's SAM notebook, the reference of tests/test_sam.py: the code cells of
``examples/contrib/sam.ipynb`` (optax, Apache-2.0, commit 97663df1 of the notebook) that build
the optimizers and run the training loop, copied verbatim.

Left out: the plotting (``import matplotlib.pyplot as plt`` in cell 1, the loss surface after
``def loss`` in cell 11, the figure cells). The opaque part repeats four cells of the
transparent part (28, 30 and 31 are 12, 14 and 15; 32 is 16 with ``T = 4000``): each is
written once. The one change at run time: the loop's ``T`` becomes the ``steps`` asked for.
"""

from __future__ import annotations

from typing import Any

# cell 1
IMPORTS = """\
from typing import NamedTuple

import jax
import jax.numpy as np
import optax
from optax import contrib
"""

# cell 11, less the plot
LOSS = """\
# An example 2D loss function. It has two minima at (0,0) and (2,0).
# Both points attain almost zero loss value, but the first one is much sharper.

def loss(params):
  x, y = params
  return -np.exp(-(x - 2)**2 - y**2) - 1.0*np.exp(-((x)**2 + (y)**2*100))
"""

# cells 12 and 28
STORES = """\
params = np.array([-0.4, -0.4])

class Store(NamedTuple):
  params: jax.typing.ArrayLike
  state: optax.OptState
  step: int = 0

sam_store = Store(params=params, state=sam_opt.init(params))
sgd_store = Store(params=params, state=sgd_opt.init(params))
sam_mom_store = Store(params=params, state=sam_mom_opt.init(params))
mom_store = Store(params=params, state=mom_opt.init(params))
sam_adam_store = Store(params=params, state=sam_adam_opt.init(params))
adam_store = Store(params=params, state=adam_opt.init(params))
"""

# cells 14 and 30
STEP_FUNCTIONS = """\
sam_step = make_step(sam_opt)
sgd_step = make_step(sgd_opt)

sam_mom_step = make_step(sam_mom_opt)
mom_step = make_step(mom_opt)

sam_adam_step = make_step(sam_adam_opt)
adam_step = make_step(adam_opt)
"""

# cells 15 and 31
LISTS = """\
sam_vals = []
sam_params = []
sgd_vals = []
sgd_params = []

sam_mom_vals = []
sam_mom_params = []
mom_vals = []
mom_params = []

sam_adam_vals = []
sam_adam_params = []
adam_vals = []
adam_params = []
"""

# cell 16; cell 32 with T = 4000
LOOP = """\
T = 8000
for i in range(T):
  sam_store, sam_val = sam_step(sam_store)
  sgd_store, sgd_val = sgd_step(sgd_store)
  sam_mom_store, sam_mom_val = sam_mom_step(sam_mom_store)
  mom_store, mom_val = mom_step(mom_store)
  sam_adam_store, sam_adam_val = sam_adam_step(sam_adam_store)
  adam_store, adam_val = adam_step(adam_store)

  sam_vals.append(sam_val)
  sgd_vals.append(sgd_val)
  sam_mom_vals.append(sam_mom_val)
  mom_vals.append(mom_val)
  sam_adam_vals.append(sam_adam_val)
  adam_vals.append(adam_val)

  sam_params.append(sam_store.params)
  sgd_params.append(sgd_store.params)
  sam_mom_params.append(sam_mom_store.params)
  mom_params.append(mom_store.params)
  sam_adam_params.append(sam_adam_store.params)
  adam_params.append(adam_store.params)
"""

TRANSPARENT = [
    IMPORTS,
    # cell 5
    """\
lr = 0.01
rho = 0.1
opt = optax.sgd(lr)
adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
sam_opt = contrib.sam(opt, adv_opt, sync_period=2)  # This is the drop-in SAM optimizer.

sgd_opt = optax.sgd(lr)  # Baseline SGD optimizer
""",
    # cell 7
    """\
def sam_mom(lr=1e-3, momentum=0.1, rho=0.1, sync_period=2):
  opt = optax.sgd(lr, momentum=momentum)
  adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period)

mom = 0.9
sam_mom_opt = sam_mom(lr, momentum=mom)
mom_opt = optax.sgd(lr, momentum=mom)
""",
    # cell 9
    '''\
def sam_adam(lr=1e-3, b1=0.9, b2=0.999, rho=0.03, sync_period=5):
  """A SAM optimizer using Adam for the outer optimizer."""
  opt = optax.adam(lr, b1=b1, b2=b2)
  adv_opt = optax.chain(contrib.normalize(), optax.adam(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period)

sam_adam_opt = sam_adam(lr)
adam_opt = optax.adam(lr)
''',
    LOSS,
    STORES,
    # cell 13
    """\
def make_step(opt):
  @jax.jit
  def step(store):
    value, grads = jax.value_and_grad(loss)(store.params)
    updates, state = opt.update(grads, store.state, store.params)
    params = optax.apply_updates(store.params, updates)
    return store._replace(
        params=params,
        state=state,
        step=store.step+1), value
  return step
""",
    STEP_FUNCTIONS,
    LISTS,
    LOOP,
]

OPAQUE = [
    IMPORTS,
    LOSS,
    # cell 23
    """\
lr = 0.01
rho = 0.1
opt = optax.sgd(lr)
adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
sam_opt = contrib.sam(opt, adv_opt, sync_period=2, opaque_mode=True)

sgd_opt = optax.sgd(lr)  # Baseline SGD optimizer
""",
    # cell 25
    """\
def sam_mom(lr=1e-3, momentum=0.1, rho=0.1, sync_period=2):
  opt = optax.sgd(lr, momentum=momentum)
  adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period, opaque_mode=True)

mom = 0.9
sam_mom_opt = sam_mom(lr, momentum=mom)
mom_opt = optax.sgd(lr, momentum=mom)
""",
    # cell 27
    '''\
def sam_adam(lr=1e-3, b1=0.9, b2=0.999, rho=0.03, sync_period=5):
  """A SAM optimizer using Adam for the outer optimizer."""
  opt = optax.adam(lr, b1=b1, b2=b2)
  adv_opt = optax.chain(contrib.normalize(), optax.adam(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period, opaque_mode=True)

sam_adam_opt = sam_adam(lr)
adam_opt = optax.adam(lr)
''',
    STORES,
    # cell 29
    """\
def make_step(opt):
  @jax.jit
  def step(store):
    value, grads = jax.value_and_grad(loss)(store.params)
    if isinstance(store.state, contrib.SAMState):
      updates, state = opt.update(
          grads, store.state, store.params,
          grad_fn=jax.grad(lambda p, _: loss(p)))  # NOTICE THE ADDITIONAL grad_fn ARGUMENT!
    else:
      updates, state = opt.update(grads, store.state, store.params)
    params = optax.apply_updates(store.params, updates)
    return store._replace(
        params=params,
        state=state,
        step=store.step+1), value
  return step
""",
    STEP_FUNCTIONS,
    LISTS,
    LOOP,
]


def run(mode: str, steps: int) -> dict[str, Any]:
    """Runs the notebook's cells of ``mode`` ("transparent" or "opaque") in a fresh namespace,
    the loop for ``steps`` steps, and returns the namespace (``sam_opt``, ``sam_store``,
    ``sam_vals``, ``sam_params``, ``make_step``, ``Store``, ``params``, ``loss``...)."""
    cells = TRANSPARENT if mode == "transparent" else OPAQUE
    namespace: dict[str, Any] = {}
    for source in cells:
        source = source.replace("T = 8000", f"T = {steps}")
        exec(compile(source, f"sam.ipynb ({mode})", "exec"), namespace)
    return namespace
