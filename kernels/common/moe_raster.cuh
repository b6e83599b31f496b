// The MoE kernels' tile order (kernels/moe.cu): column bands and MoeRaster, the GEMM's
// scheduler, which maps ticket t of the dynamic schedule to its tile. Plain integer
// arithmetic over the layout's tables, so tests/schedule_vectors.rs compiles it as host C++
// and checks it against its host mirror, ops::moe::moe_tile_banded, tile by tile.
#pragma once
#include "gemm/scheduler.cuh"

namespace mk { namespace moe {

// A layout word written earlier in this kernel by another CTA (L2, not the L1 of this SM).
__device__ __forceinline__ int ld_cg(const int* p) { return __ldcg(p); }

// Column bands of band_w columns (MoeParams::band_w, which divides tiles_n; host mirror
// ops::moe::band_locate): u counts units (tiles_m per column for the GEMM's tiles, tokens
// per column for the pull's items) band by band; on return u is the unit within its band,
// w the band's width, and the result its first column.
__device__ __forceinline__ int band_locate(int per_col, int band_w, int& u, int& w) {
  const int band = u / (per_col * band_w);
  u -= band * per_col * band_w;
  w = band_w;
  return band * band_w;
}

// Tiles: t -> grouped raster over (ordered m-block index, n-block); the m-block index goes
// through the order table (identity when null), and the B row block is the expert's
// (E_local·N_total view). With a run table, raster groups never straddle two runs (a run:
// consecutive order positions of one expert, and for the dispatch one order key): a run of
// L blocks is cut into ceil(L / group_m) groups of balanced sizes, so the tiles that share
// an expert's B tile run in the same wave. Host mirror: ops::moe::moe_tile.
// The schedule is dynamic (engine.cuh HasTickets): the GEMM CTAs take tiles t = 0, 1, ...
// in this order from the MOE_TILE_NEXT ticket counter, so the order above is the order in
// which tiles start, and a CTA that finishes early (fewer rows to wait for, a prep it did
// not run, slabs past an expert's rows skipped) takes the next tile instead of idling.
struct MoeRaster {
  struct Params {
    const int* order;      // m-block order (layout); null: identity
    const int* runs;       // per m-block: first order position of its run | length << 15; null: fixed groups
    const int* mb_expert;  // local expert of each m-block (layout)
    const int* mb_rows;    // rows of each m-block in use (layout): 1..128
    int tiles_m, tiles_n;
    int band_w;  // column tiles per band (divides tiles_n, band_locate): the raster runs band by band
    int group_m;
    unsigned long long* tickets;  // this rank's MOE_TILE_NEXT
  };
  __device__ static unsigned long long* tickets(const Params& p) { return p.tickets; }
  // The engine skips the wgmmas of a 64-row consumer slab at or past this row: an expert's
  // last m-block holds (rows mod 128) rows, and at 4 ranks (T 4096, k 8, E 256: ~512 +- 22
  // rows per expert) about half of the experts end in a block of <= 64 rows: ~16 of ~288
  // blocks' tensor work was padding. The unfused per-expert GEMMs (M = the expert's rows)
  // skip it too. The slab's stale accumulators go to padding rows (Y: unspecified; Z: never read).
  __device__ static int rows_end(const Params& p, const gemm::TileCoord& c, int) {
    return c.m_block * 128 + ld_cg(p.mb_rows + c.m_block);
  }
  __device__ static gemm::TileCoord tile(const Params& p, int t) {
    // Bands (the combine: its pull follows them): band b's tiles, then band b + 1's, each
    // band rastered as below over its bw column tiles.
    int bw;
    const int col0 = band_locate(p.tiles_m, p.band_w, t, bw);
    int pos, nb;
    if (p.runs == nullptr) {
      const gemm::TileCoord c = gemm::grouped_tile(p.tiles_m, bw, p.group_m, t);
      pos = c.m_block;
      nb = c.n_block;
    } else {
      // Groups tile the order positions, so position t / bw lies in t's group.
      const int at = t / bw;
      const int info = ld_cg(p.runs + (p.order ? ld_cg(p.order + at) : at));
      const int rs = info & 0x7fff, len = info >> 15;
      const int groups = (len + p.group_m - 1) / p.group_m;
      const int q = len / groups, r = len % groups, o = at - rs;  // r groups of q + 1, then q
      int gs, gl;
      if (o < r * (q + 1)) {
        gs = o / (q + 1) * (q + 1);
        gl = q + 1;
      } else {
        gs = r * (q + 1) + (o - r * (q + 1)) / q * q;
        gl = q;
      }
      gs += rs;
      const int in_group = t - gs * bw;
      pos = gs + in_group % gl;
      nb = in_group / gl;
    }
    const int mb = p.order ? ld_cg(p.order + pos) : pos;
    return gemm::TileCoord{mb, ld_cg(p.mb_expert + mb) * p.tiles_n + col0 + nb};
  }
};

}  // namespace moe
}  // namespace mk
