"""Stall samples of an ncu source-page CSV (`ncu -i R --page source --csv --print-source sass`): the
totals by stall reason, the SASS lines that collect most samples, and the samples by opcode.

    python tools/ncu_sass_top.py sass.csv [lines]
"""
import csv, sys
rows=list(csv.reader(open(sys.argv[1])))
head=rows[1]; data=rows[2:]
ix={c:i for i,c in enumerate(head)}
def f(r,c):
    try: return float(r[ix[c]].replace(",",""))
    except: return 0.0
tot=sum(f(r,"Warp Stall Sampling (All Samples)") for r in data)
print("total samples",tot)
stalls=[c for c in head if c.startswith("stall_") and "Not Issued" not in c]
agg={s:sum(f(r,s) for r in data) for s in stalls}
print([(k,round(100*v/tot,1)) for v,k in sorted(((v,k) for k,v in agg.items()),reverse=True)[:9]])
top=sorted(data,key=lambda r:-f(r,"Warp Stall Sampling (All Samples)"))[:int(sys.argv[2]) if len(sys.argv)>2 else 30]
for r in top:
    st=sorted(((f(r,s),s) for s in stalls),reverse=True)[:2]
    print(f"{100*f(r,'Warp Stall Sampling (All Samples)')/tot:5.1f}% {r[ix['Address']][-5:]:>6} {r[ix['Source']][:58]:58} {st[0][1][6:]}:{st[0][0]:.0f} {st[1][1][6:]}:{st[1][0]:.0f} L2x={f(r,'L2 Theoretical Sectors Global Excessive'):.0f} shX={f(r,'L1 Wavefronts Shared Excessive'):.0f}")
# by opcode
from collections import Counter
c=Counter()
for r in data:
    op=r[ix['Source']].split()[0] if r[ix['Source']].split() else ''
    if op.startswith('@'): op=r[ix['Source']].split()[1]
    c[op.split('.')[0]]+=f(r,"Warp Stall Sampling (All Samples)")
print([(k,round(100*v/tot,1)) for k,v in c.most_common(15)])
