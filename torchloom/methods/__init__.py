"""Credit-assignment rules, one module each, every one a ``torchloom.Method`` run by the engine.

| name | module | rule |
|---|---|---|
| ``"backprop"`` | ``backprop.py`` | exact gradients through the hand-written backward, any optimizer |
| ``"target_prop"`` | ``target_prop.py`` (the method), ``target_prop_rules.py`` (settings, state, Loom's functional API), ``target_prop_pure.py`` (pure mode's estimates) | Loom's target propagation: chain-rule or pure (derivative-free) targets, link budgets, gates, depth-scaled momentum |
| ``"tween"`` | ``tween.py`` (the method), ``tween_rules.py`` (settings, ``TweenState``), ``explosion.py`` | Loom's Neural Tweening: gaps, link budgets, alignments, explosion detection and recovery |
| ``"feedback_alignment"`` | ``feedback_alignment.py`` | fixed random feedback ``B_l`` in place of ``W_lᵀ`` (Lillicrap et al. 2016) |
| ``"dfa"`` | ``dfa.py`` | the output error sent straight to every hidden layer through fixed random ``B_l`` (Nøkland 2016) |
| ``"sign_symmetry"`` | ``sign_symmetry.py`` | ``sign(W_l)ᵀ`` as feedback (Liao et al. 2016, uSF) |
| ``"fast_proxy"`` | ``fast_proxy.py`` | Welvet's FastProxy: ``W_headᵀ g_y`` block-averaged to every hidden layer |

``_feedback.py`` holds what the four feedback rules share (each a ``Backprop`` with its own
``backward``); ``_fused.py`` holds what TargetProp's and Tweening's fused device steps share; ``trainers.py`` the
per-method trainer classes of earlier releases (the engine given one method each). Importing this package
registers each rule's name with the engine (``torchloom.register_method``); a rule of your own
registers the same way, or is given to ``TrainingConfig(method=...)`` as an object.
"""

from .backprop import Backprop, LossScaler
from .target_prop import (
    TargetProp,
    TargetPropConfig,
    TargetPropState,
    apply_target_prop_gaps,
    estimate_input_target,
    target_prop_backward,
    target_prop_forward,
)
from .trainers import BackpropTrainer, TargetPropTrainer, TweenTrainer
from .tween import Tween, TweenConfig, TweenState

# the feedback rules, registered after the three above (method_names() lists them in this order)
from .feedback_alignment import FeedbackAlignment, FeedbackAlignmentConfig  # noqa: E402
from .dfa import DFA, DFAConfig  # noqa: E402
from .sign_symmetry import SignSymmetry, SignSymmetryConfig  # noqa: E402
from .fast_proxy import FastProxy, FastProxyConfig  # noqa: E402

__all__ = [
    "Backprop", "BackpropTrainer", "LossScaler",
    "TargetProp", "TargetPropConfig", "TargetPropState", "TargetPropTrainer", "target_prop_forward",
    "target_prop_backward", "apply_target_prop_gaps", "estimate_input_target",
    "Tween", "TweenConfig", "TweenState", "TweenTrainer",
    "FeedbackAlignment", "FeedbackAlignmentConfig", "DFA", "DFAConfig", "SignSymmetry", "SignSymmetryConfig",
    "FastProxy", "FastProxyConfig",
]
