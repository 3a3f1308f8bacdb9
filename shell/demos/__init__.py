"""The ``nnxscan demo`` programs: ``digits`` (an MLP on scikit-learn's digits), ``hypernet``
(one hypernetwork learns a family of functions), ``hypernet-cl``, ``sweep`` and ``ppo``
(PureJaxRL's PPO on gymnax's CartPole). They need the ``demo`` extra; ``ppo`` the ``rl`` one."""
