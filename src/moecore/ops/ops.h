// Every op: model, MoE and optimizer code include this (or one family header) and never a backend's kernels.
#pragma once

#include "moecore/ops/activation.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/device.h"
#include "moecore/ops/dropout.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/expert_activation.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/linear_cross_entropy.h"
#include "moecore/ops/loss.h"
#include "moecore/ops/norm.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/routing.h"
#include "moecore/ops/rows.h"
