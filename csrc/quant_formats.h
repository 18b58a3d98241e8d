// The GGUF block formats of quant_gemm.cpp (layouts in its top comment; gguf-py's gguf.quants
// and llama.cpp's ggml-common.h are the references): each says how many values (BK) a block of
// BYTES bytes holds, reads the block's scales once (prep) and dequantizes its g-th run of 32
// values into 4 vectors of 8 fp32 (group).
#pragma once

#include <cstdint>
#include <cstring>

#include "quant_vec.h"

namespace radixlm_quant {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// A format: BK values in BYTES bytes per block; prep() reads a block's scales once, group(g)
// dequantizes its g-th run of 32 values into 4 vectors of 8. The 32-value formats are also
// FACTORED (quant_direct.h's row_dot): w = d q (+ m), so a block's sum of w x is d (q . x)
// (+ m sum(x)): quants() gives q alone, scale() d, minv() m.
struct Q8_0 {
  static constexpr int BK = 32, BYTES = 34;
  static constexpr bool kFactored = true, kMin = false;
  static float scale(const uint8_t* b) { return f16(b); }
  static float minv(const uint8_t*) { return 0.f; }
  static void quants(const uint8_t* b, V q[4]) {
    for (int i = 0; i < 4; ++i) q[i] = vload_i8(b + 2 + 8 * i);
  }
  struct P { V d; };
  static P prep(const uint8_t* b) { return {vset1(f16(b))}; }
  static void group(const uint8_t* b, const P& p, int, V w[4]) {
    for (int i = 0; i < 4; ++i) w[i] = vmul(vload_i8(b + 2 + 8 * i), p.d);
  }
};

struct Q4_1 {
  static constexpr int BK = 32, BYTES = 20;
  static constexpr bool kFactored = true, kMin = true;
  static float scale(const uint8_t* b) { return f16(b); }
  static float minv(const uint8_t* b) { return f16(b + 2); }
  static void quants(const uint8_t* b, V q[4]) { load_nibbles16(b + 4, q); }  // q[0..31]
  struct P { V d, m; };
  static P prep(const uint8_t* b) { return {vset1(f16(b)), vset1(f16(b + 2))}; }
  static void group(const uint8_t* b, const P& p, int, V w[4]) {
    load_nibbles16(b + 4, w);  // q[0..31] as floats
    for (int i = 0; i < 4; ++i) w[i] = vfma(w[i], p.d, p.m);
  }
};

struct Q4_K {
  static constexpr int BK = 256, BYTES = 144;
  static constexpr bool kFactored = false, kMin = false;  // (row_dot dequantizes each group)
  struct P { float sc[8], mn[8]; };
  static P prep(const uint8_t* b) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* s = b + 4;
    P p;
    for (int j = 0; j < 8; ++j) {  // llama.cpp's get_scale_min_k4
      int sc, m;
      if (j < 4) {
        sc = s[j] & 63; m = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      p.sc[j] = d * sc;   // exact: 11-bit mantissa x 6-bit integer
      p.mn[j] = dmin * m;
    }
    return p;
  }
  static void group(const uint8_t* b, const P& p, int j, V w[4]) {
    load_nibbles32(b + 16 + 32 * (j >> 1), j & 1, w);
    const V sc = vset1(p.sc[j]), mn = vset1(p.mn[j]);
    for (int i = 0; i < 4; ++i) w[i] = vfmsub(w[i], sc, mn);
  }
};

// Q6_K (14): 256 values in 210 bytes: ql[128] low 4 bits, qh[64] high 2 bits, 16 int8 scales
// (one per 16 values), fp16 d last. Group g (32 values): h = g / 4, r = g % 4; low bits are
// nibble r / 2 of ql[64h + 32 (r % 2) + i], high bits are bits 2r of qh[32h + i];
// w = (d * sc[2g + i / 16]) * (q - 32) (gguf.quants.Q6_K)
struct Q6_K {
  static constexpr int BK = 256, BYTES = 210;
  static constexpr bool kFactored = false, kMin = false;  // (row_dot dequantizes each group)
  struct P { float sc[16]; };
  static P prep(const uint8_t* b) {
    const float d = f16(b + 208);
    P p;
    for (int j = 0; j < 16; ++j) p.sc[j] = d * static_cast<int8_t>(b[192 + j]);  // exact
    return p;
  }
  static void group(const uint8_t* b, const P& p, int g, V w[4]) {
    const int h = g >> 2, r = g & 3;
    load_q6(b + 64 * h + 32 * (r & 1), b + 128 + 32 * h, r >> 1, r, w);
    const V s0 = vset1(p.sc[2 * g]), s1 = vset1(p.sc[2 * g + 1]);
    w[0] = vmul(w[0], s0); w[1] = vmul(w[1], s0);
    w[2] = vmul(w[2], s1); w[3] = vmul(w[3], s1);
  }
};

}  // namespace radixlm_quant
